"""benchmarks/codec_profile.py: one tiny real run writes a row per spec with its wall time and host syncs."""
import re
import subprocess
import sys

from tests.integration.launch import HANG_S, ROOT


def test_codec_profile_writes_a_row_per_spec_and_counts_the_nan_check_syncs(tmp_path):
    out = tmp_path / "profile.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/codec_profile.py"), "--device", "cpu", "--spec", "identity",
                    "--spec", "int8", "--shape", "2x16x64", "--rounds", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=HANG_S)
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `([^`]+)` \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (\d+) \|$", out.read_text(), re.M)}
    assert set(rows) == {"identity", "int8"}
    assert float(rows["int8"][0]) > 0 and int(rows["int8"][3]) >= 1  # the NaN/Inf check reads a value on the host
    assert int(rows["identity"][3]) < int(rows["int8"][3])


def test_codec_profile_shapes_lists_an_operators_calls_per_input_shape(tmp_path):
    out = tmp_path / "profile.md"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/codec_profile.py"), "--device", "cpu", "--spec", "int8",
                    "--shape", "2x16x64", "--rounds", "2", "--top", "50", "--shapes", "--out", str(out)],
                   check=True, capture_output=True, timeout=HANG_S)
    ops = re.findall(r"^\| `int8` \| (aten::\w+) (\[.*\]) \| \d+ \| [\d.]+ \|$", out.read_text(), re.M)
    assert ("aten::sum", "[[2, 16, 64], []]") in ops  # the NaN/Inf check sums the whole (2, 16, 64) input
