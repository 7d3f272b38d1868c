"""Validation before any process work: one message, from rank 0, exit status 2."""
import argparse
import json

import pytest

from pp_compress.runtime import check_args, spec_arg


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp-compress", dest="pp_compress", type=spec_arg)
    ap.add_argument("--deepspeed_config")
    return ap


def test_a_bad_spec_stops_parsing_with_one_message_on_rank0(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--pp-compress", "int8:per=rows"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --pp-compress 'int8:per=rows'") and "accepted: tensor | row" in err


def test_other_ranks_exit_quietly(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--pp-compress", "bogus"])
    assert e.value.code == 2 and capsys.readouterr().err == ""


def test_good_specs_pass_through_unchanged():
    assert _parser().parse_args(["--pp-compress", "safe,warmup=10"]).pp_compress == "safe,warmup=10"


def test_the_config_section_is_checked_too(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"pp_compress": {"activations": "int8", "gradient": "int8"}}))
    with pytest.raises(SystemExit) as e:
        check_args(_parser().parse_args(["--deepspeed_config", str(path)]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(path) in err and "'gradient'" in err and "gradients" in err
    path.write_text(json.dumps({"pp_compress": {"activations": "int8", "gradients": "int3:stoch"}}))
    assert str(check_args(_parser().parse_args(["--deepspeed_config", str(path)]))) == "act=int8,grad=int3:stoch"
    # the flag wins over the section
    assert str(check_args(_parser().parse_args(["--deepspeed_config", str(path), "--pp-compress", "none"]))) == \
        "act=identity,grad=identity"


def test_a_missing_config_file_is_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        check_args(_parser().parse_args(["--deepspeed_config", str(tmp_path / "nope.json")]))
    assert "nope.json" in capsys.readouterr().err


def test_a_yaml_config_reads_as_its_json_twin_and_bad_ones_say_which_file(tmp_path):
    from pp_compress.runtime import load_json, resolve_config

    (tmp_path / "c.yaml").write_text("train_batch_size: 8\npp_compress:\n  activations: int8:rot\n  gradients: int8\n")
    (tmp_path / "c.json").write_text('{"train_batch_size": 8, "pp_compress": {"activations": "int8:rot", '
                                     '"gradients": "int8"}}')
    assert load_json(str(tmp_path / "c.yaml")) == load_json(str(tmp_path / "c.json"))
    rest, cfg = resolve_config(str(tmp_path / "c.yaml"), None)
    assert rest == {"train_batch_size": 8} and str(cfg) == "act=int8:rot,grad=int8"
    (tmp_path / "list.yml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"list.yml: expected a mapping at the top, got list"):
        load_json(str(tmp_path / "list.yml"))
    (tmp_path / "broken.yaml").write_text("pp_compress: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken.yaml: "):
        load_json(str(tmp_path / "broken.yaml"))
