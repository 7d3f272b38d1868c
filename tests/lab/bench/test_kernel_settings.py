"""pp_lab.bench.kernel_settings: the kernels' settings a benchmark measures side by side, set and restored."""
import argparse

import pytest

from pp_compress.ops import triton_int
from pp_lab.bench import kernel_settings


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    kernel_settings.add_arguments(ap)
    return ap.parse_args(list(argv))


def test_every_combination_of_the_values_given_in_order():
    assert kernel_settings.settings(parse()) == [()]
    got = kernel_settings.settings(parse("--rows-per-program", "2", "--sign-table-rows", "off",
                                         "--sign-table-rows", "4096"))
    assert got == [(("rows_per_program", 2), ("sign_table_rows", None)),
                   (("rows_per_program", 2), ("sign_table_rows", 4096))]
    assert [kernel_settings.label(s) for s in got] == [" [2 rows/program, signs hashed]",
                                                       " [2 rows/program, sign table from 4096 rows]"]
    assert kernel_settings.label(()) == ""
    both = kernel_settings.settings(parse("--butterfly", "split", "--butterfly", "sum"))
    assert [kernel_settings.label(s) for s in both] == [" [split butterfly]", " [sum butterfly]"]


def test_a_setting_holds_within_and_the_defaults_come_back_even_after_an_error():
    before = (triton_int.ROWS_PER_PROGRAM, triton_int.SIGN_TABLE_ROWS, triton_int.BUTTERFLY)
    with pytest.raises(RuntimeError):
        with kernel_settings.applied((("rows_per_program", 4), ("sign_table_rows", 0), ("butterfly", "sum"))):
            assert (triton_int.ROWS_PER_PROGRAM, triton_int.SIGN_TABLE_ROWS, triton_int.BUTTERFLY) == (4, 0, "sum")
            assert triton_int.rows_per_program(8192, 128) == 4  # its cache was cleared
            raise RuntimeError
    assert (triton_int.ROWS_PER_PROGRAM, triton_int.SIGN_TABLE_ROWS, triton_int.BUTTERFLY) == before
    assert triton_int.rows_per_program(8192, 128) == before[0]


@pytest.mark.parametrize("argv,says", [(("--rows-per-program", "0"), "'0'; accepted: an integer >= 1"),
                                       (("--rows-per-program", "x"), "'x'; accepted: an integer >= 1"),
                                       (("--sign-table-rows", "-3"), "'-3'; accepted: off, or an integer >= 0"),
                                       (("--sign-table-rows", "never"), "'never'; accepted: off, or an integer >= 0"),
                                       (("--butterfly", "radix4"),
                                        "invalid choice: 'radix4' (choose from 'split', 'sum')")])
def test_bad_values_are_refused_by_name_with_the_accepted_ones(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert says in capsys.readouterr().err
