"""benchmarks/ops.py: one tiny real run writes the table and CSV with both memcpy references."""
import csv
import subprocess
import sys

from tests.integration.launch import HANG_S, ROOT


def test_ops_benchmark_writes_rows_with_clone_and_copy_references(tmp_path):
    out = tmp_path / "ops"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/ops.py"), "--spec", "int8", "--spec", "topk:0.1", "--shape",
                    "2x64x96", "--dtype", "fp32", "--reps", "2", "--out", str(out)], check=True, capture_output=True, timeout=HANG_S)
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert [r["spec"] for r in rows] == ["int8", "topk:0.1"]
    for r in rows:
        assert float(r["clone_GBps"]) > 0 and float(r["copy_GBps"]) > 0 and float(r["vs_copy"]) > 0
    assert abs(float(rows[0]["ratio"]) - 4 * 96 / (96 + 2)) < 0.01  # int8 codes + one bf16 scale per row of 96
    assert float(rows[1]["topk_ms"]) > 0
    md = out.with_suffix(".md").read_text()
    assert "| 2x64x96 | fp32 | " in md and "int8 vs copy_" in md


def test_ops_benchmark_times_each_spec_at_each_kernel_setting(tmp_path):
    out = tmp_path / "ops"
    ops = str(ROOT / "benchmarks/ops.py")
    subprocess.run([sys.executable, ops, "--spec", "int8:rot", "--shape", "2x8x64", "--dtype", "fp32", "--reps", "1",
                    "--rows-per-program", "1", "--rows-per-program", "4", "--sign-table-rows", "off",
                    "--sign-table-rows", "0", "--out", str(out)], check=True, capture_output=True, timeout=HANG_S)
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert [r["spec"] for r in rows] == [f"int8:rot [{n} rows/program, {signs}]" for n in (1, 4)
                                         for signs in ("signs hashed", "sign table from 0 rows")]
    for arg, value, accepted in [("--rows-per-program", "0", "an integer >= 1"),
                                 ("--sign-table-rows", "-1", "off, or an integer >= 0")]:
        bad = subprocess.run([sys.executable, ops, arg, value], capture_output=True, text=True, timeout=HANG_S)
        assert bad.returncode != 0 and f"{arg}: '{value}'; accepted: {accepted}" in bad.stderr
