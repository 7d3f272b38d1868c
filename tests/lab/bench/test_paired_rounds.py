"""pp_lab.bench.paired_rounds: one setting against the others round by round, pooled over runs."""
import pytest

from pp_lab.bench import paired_rounds as pr

HEADER = "mode,link,rate_mbit,latency_ms,spec,step_s,rounds\n"


def write(path, rows):
    path.write_text(HEADER + "".join(f"netns,{link},0,0,{spec},0,{rounds}\n" for link, spec, rounds in rows))
    return path


def test_rounds_are_paired_within_a_run_and_pooled_across_runs(tmp_path):
    a = write(tmp_path / "a.csv", [("none", "none", "1.0 2.0"), ("none", "auto", "1.1 2.0"),
                                   ("5mbit", "auto", "9 9")])
    b = write(tmp_path / "b.csv", [("none", "none", "0.5 0.5"), ("none", "auto", "0.5 0.55")])
    runs = {p.stem: pr.rounds(p, "none") for p in (a, b)}
    assert runs["a"] == {"none": [1.0, 2.0], "auto": [1.1, 2.0]}  # the other link's rows are not read
    r = pr.ratios(runs, "auto", "none")
    assert r == pytest.approx([1.1, 1.0, 1.0, 1.1])  # each round against its own, not run means (1.55 / 1.5)
    mean, lo, hi = pr.interval(r, 0.95)
    assert mean == pytest.approx(0.05) and lo < 0.05 < hi
    assert hi - mean == pytest.approx(3.182446 * 0.057735 / 2, rel=1e-4)  # t(0.975, 3) * sd / sqrt(4)
    md = pr.table(runs, "auto", 0.05, 0.95, "cmd")
    assert "| `none` | 4 | +5.0% |" in md and md.count("| no |") == 1
    assert "| a | +5.0% |" in md and "| b | +5.0% |" in md


def test_runs_whose_specs_have_different_rounds_are_refused(tmp_path):
    a = write(tmp_path / "a.csv", [("none", "none", "1.0 2.0"), ("none", "auto", "1.1")])
    with pytest.raises(SystemExit, match="auto has 1 rounds, none 2; accepted: the same number"):
        pr.ratios({"a": pr.rounds(a, "none")}, "auto", "none")
