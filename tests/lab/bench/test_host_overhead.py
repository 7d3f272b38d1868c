"""benchmarks/host_overhead.py: one tiny real run on CPU writes its tables, the in-process boundary's among them."""
import subprocess
import sys

from tests.integration.launch import HANG_S, ROOT


def test_host_overhead_writes_the_boundary_table_next_to_a_plain_clone(tmp_path):
    out = tmp_path / "host.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/host_overhead.py"), "--device", "cpu", "--spec", "identity",
                           "--spec", "int8", "--small", "2x8x64", "--large", "2x8x64", "--dtype", "fp32", "--calls", "3",
                           "--rounds", "3", "--boundary", "--out", str(out)], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    md = out.read_text()
    table = md.split("through an in-process boundary", 1)[1].splitlines()
    rows = [r for r in table if r.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`(clone, no boundary)`", "`identity`", "`int8`"]
    assert rows[0].endswith("| +0.0 |")  # the reference's own extra
    assert float(rows[2].split("|")[2]) > 0


def test_the_boundary_profile_shows_its_backward_and_the_package_by_cumulative_time(tmp_path):
    out = tmp_path / "host.md"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/host_overhead.py"), "--device", "cpu", "--spec", "int8",
                           "--small", "2x8x64", "--large", "2x8x64", "--dtype", "fp32", "--calls", "3", "--rounds", "3",
                           "--boundary", "--profile", "--out", str(out)], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    section = out.read_text().split("`int8`'s boundary", 1)[1]
    assert "The package's own functions by cumulative time" in section
    assert "pp_compress/boundary.py:" in section and "(backward)" in section
