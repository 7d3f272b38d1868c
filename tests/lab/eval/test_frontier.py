"""eval/frontier.py: steps and time to target, the links' comm/compute ratio, the per-setting frontier rows."""
import json
import math

import pytest

from pp_lab.eval import frontier as fr


def test_steps_to_target_interpolates_on_the_validation_curve():
    curve = [(100, 6.0), (200, 5.0), (300, 4.5), (400, 4.4)]
    assert fr.steps_to_target(curve, 5.0) == 200.0  # reached exactly at an evaluation
    assert fr.steps_to_target(curve, 4.75) == pytest.approx(250.0)  # halfway between 200 (5.0) and 300 (4.5)
    assert fr.steps_to_target(curve, 4.42) == pytest.approx(380.0)
    assert fr.steps_to_target(curve, 4.39) is None  # never reached: "never", not the last step
    assert fr.steps_to_target(curve, 7.0) == 100.0  # already there at the first evaluation
    # the first crossing counts, even if the curve rises again later (overfitting)
    assert fr.steps_to_target([(50, 5.0), (100, 4.0), (150, 4.6)], 4.5) == pytest.approx(75.0)


def test_time_to_target_and_the_comm_compute_ratio():
    assert fr.comm_ratio(11.0, 1.0) == 10.0
    assert fr.time_to_target(800.0, 0.5) == 400.0
    assert fr.time_to_target(None, 0.5) is None
    # an uncompressed warm-up: its steps take the uncompressed step time
    assert fr.time_to_target(800.0, 0.5, warmup=100, warm_step_s=2.0) == 100 * 2.0 + 700 * 0.5
    assert fr.time_to_target(50.0, 0.5, warmup=100, warm_step_s=2.0) == 50 * 2.0


def test_tolerance_is_twice_the_seed_gap_and_at_least_0_02():
    assert fr.tolerance(0.031) == pytest.approx(0.062)
    assert fr.tolerance(0.001) == 0.02
    assert fr.tolerance(None) is None


def test_e2e_key_ignores_warmup_and_spelling():
    assert fr.e2e_key("act=int4,grad=int3:stoch,warmup=100", []) == fr.e2e_key("act=int4,grad=int3:stoch", [])
    assert fr.e2e_key("int8", ["--subspace", "48"]) == fr.e2e_key("act=int8,grad=int8", ["--subspace", "48"])
    assert fr.e2e_key("int8", []) != fr.e2e_key("int8", ["--subspace", "48"])


def test_e2e_key_leaves_out_the_run_length():
    """A 600-step run of a setting takes the step times e2e measured for that setting in a short run."""
    bn = ["--bottleneck", "288", "--bottleneck-tokens"]
    assert fr.e2e_key("vq:4", [*bn, "--steps", "600"]) == fr.e2e_key("vq:4", bn)
    assert fr.e2e_key("vq:4", bn).endswith(" --bottleneck 288 --bottleneck-tokens")
    assert fr.e2e_key("vq:4", ["--steps", "600", *bn]) == fr.e2e_key("vq:4", bn)


def _run(final_curve, act_wire, grad_wire, raw=4.0):
    evals = [(s, v) for s, v in final_curve]
    return {"evals": evals, "final": evals[-1][1], "wire": act_wire + grad_wire, "act_wire": act_wire, "grad_wire": grad_wire,
            "act_raw": raw, "grad_raw": raw}


def test_frontier_rows_combine_quality_and_link_times(monkeypatch):
    settings = {"base": "none", "base-seed1": "none", "int8": "int8", "act-int4_grad-int3stoch-warm100":
                "act=int4,grad=int3:stoch,warmup=100", "slow": "int2", "long": "int2"}
    monkeypatch.setattr(fr, "EXTRA", {})
    runs = {"base": _run([(500, 5.0), (1000, 4.0)], 4.0, 4.0),
            "base-seed1": _run([(500, 5.1), (1000, 4.05)], 4.0, 4.0),
            "int8": _run([(500, 4.9), (1000, 3.9)], 1.0, 1.0),  # reaches 4.0 at step 950
            "act-int4_grad-int3stoch-warm100": _run([(500, 5.0), (1000, 4.0)], 0.5, 0.375),
            "slow": _run([(500, 5.5), (1000, 4.5)], 0.25, 0.25),
            "long": _run([(500, 5.5), (1000, 4.5), (1500, 4.0), (2000, 3.9)], 0.25, 0.25)}  # twice the baseline's steps
    none, int8, i43 = fr.e2e_key("none", []), fr.e2e_key("int8", []), fr.e2e_key("act=int4,grad=int3:stoch", [])
    def row(step_s, rate):
        return {"step_s": step_s, "rate_mbit": rate, "latency_ms": 0.0}
    first = {"none": {none: row(1.0, 0), int8: row(1.0, 0)}, "2mbit": {none: row(11.0, 2), int8: row(3.0, 2)}}
    # a later e2e run measured the int4/int3 spec, side by side with its own uncompressed rows
    later = {"none": {none: row(1.1, 0), i43: row(1.0, 0)}, "2mbit": {none: row(12.1, 2), i43: row(2.0, 2)}}
    e2e = [first, later]
    rows = {r["name"]: r for r in fr.frontier(runs, e2e, {"int8": "parity"},
                                              fr.Testbed("small GPT", settings, "base", "base-seed1", "long"))}
    b, r8 = rows["base"], rows["int8"]
    assert {r["model"] for r in rows.values()} == {"small GPT"} and r8["x_fp32"] == 4.0 and r8["x_bf16"] == 2.0
    assert b["steps_to_target"] == 1000.0 and b["links"]["2mbit"]["speedup"] == 1.0 and b["links"]["2mbit"]["r"] == 10.0
    assert r8["steps_to_target"] == pytest.approx(950.0)
    assert r8["links"]["2mbit"]["speedup"] == pytest.approx(1000 * 11.0 / (950 * 3.0))
    assert r8["bits_fwd"] == 8.0 and r8["bits_bwd"] == 8.0 and r8["wire_ratio"] == 4.0
    assert r8["noise_floor"] == pytest.approx(0.05) and r8["tolerance"] == pytest.approx(0.1)  # twice the seed gap
    assert r8["parity"] == {"loss_rule": "parity", "lm_eval": "parity"}
    w = rows["act-int4_grad-int3stoch-warm100"]
    assert w["bits_avg"] == pytest.approx((4.0 + 3.0) / 2)
    # from the later run: warm-up at that run's uncompressed step time, speedup and r against its own rows
    assert w["links"]["2mbit"]["time_to_target_s"] == pytest.approx(100 * 12.1 + 900 * 2.0)
    assert w["links"]["2mbit"]["speedup"] == pytest.approx(1000 * 12.1 / (100 * 12.1 + 900 * 2.0))
    assert w["links"]["2mbit"]["r"] == pytest.approx(10.0)
    assert rows["slow"]["links"] == {}  # measured nowhere: no number rather than a guess
    s = rows["slow"]
    assert s["steps_to_target"] is None and s["parity"]["loss_rule"] == "worse"
    assert s["base_step_at_this_loss"] == pytest.approx(500 + 0.5 / 1.0 * 500)  # the baseline had 4.5 at step 750
    assert r8["base_step_at_this_loss"] is None  # better than the baseline ever was
    assert math.isclose(s["delta"], 0.5)
    long = rows["long"]  # its final loss is past the baseline's, in twice the steps: no verdict, its steps to target
    assert long["parity"]["loss_rule"] == "2000 steps: not comparable" and long["steps_to_target"] == 1500.0


def test_a_run_with_another_optimizer_is_judged_against_that_optimizers_baseline(monkeypatch):
    """A Muon run is compared with the Muon baseline and its own seed gap, not with AdamW's baseline (which it may
    beat while falling short of its own); its bits stay against the dense tensors; without its baseline committed it
    gets no verdict rather than AdamW's; an optimizer the testbed has no baseline for is an error."""
    settings = {"base": "none", "base-seed1": "none", "muon-base": "none", "muon-base-seed1": "none", "bn-muon": "int8"}
    extra = {n: ["--optimizer", "muon"] for n in ("muon-base", "muon-base-seed1", "bn-muon")}
    monkeypatch.setattr(fr, "EXTRA", extra)
    runs = {"base": _run([(500, 5.0), (1000, 4.0)], 4.0, 4.0), "base-seed1": _run([(500, 5.1), (1000, 4.05)], 4.0, 4.0),
            "muon-base": _run([(500, 4.6), (1000, 3.8)], 4.0, 4.0),
            "muon-base-seed1": _run([(500, 4.6), (1000, 3.83)], 4.0, 4.0),
            "bn-muon": _run([(500, 4.8), (1000, 3.9)], 1.0, 1.0)}  # below AdamW's baseline, above Muon's
    bed = fr.Testbed("small GPT", settings, "base", "base-seed1", "long",
                     optimizers=(("muon", "muon-base", "muon-base-seed1"),))
    rows = {r["name"]: r for r in fr.frontier(runs, [], {}, bed)}
    bn = rows["bn-muon"]
    assert bn["baseline"] == "muon-base" and bn["delta"] == pytest.approx(0.1)
    assert bn["tolerance"] == pytest.approx(0.06)
    assert bn["parity"]["loss_rule"] == "worse" and bn["bits_avg"] == 8.0
    assert rows["muon-base"]["parity"] == {"loss_rule": "parity", "lm_eval": "baseline"}
    assert rows["base"]["baseline"] == "base"
    assert "+0.100 (0.060) vs muon-base" in "\n".join(fr.table(list(rows.values())))
    alone = fr.frontier({n: r for n, r in runs.items() if not n.startswith("muon-base")}, [], {}, bed)
    assert [(r["delta"], r["parity"]["loss_rule"]) for r in alone if r["name"] == "bn-muon"] == [(None, None)]
    monkeypatch.setattr(fr, "EXTRA", {**extra, "bn-muon": ["--optimizer", "lion"]})
    with pytest.raises(ValueError, match="bn-muon: --optimizer lion has no baseline in the small GPT testbed; "
                                         "accepted: adamw, muon"):
        fr.frontier(runs, [], {}, bed)


def test_headline_is_the_fewest_bits_at_parity_on_both_rules(monkeypatch):
    def row(name, bits, loss_rule, lm, ratio=None):
        return {"name": name, "spec": name, "options": [], "bits_avg": bits, "wire_ratio": ratio or 32 / bits, "delta": 0.0,
                "tolerance": 0.05, "steps_to_target": 900.0, "parity": {"loss_rule": loss_rule, "lm_eval": lm},
                "links": {"2mbit": {"speedup": 32 / bits, "rate_mbit": 2.0, "r": 10.0}}}
    rows = [row("base", 32, "parity", "baseline"), row("base-seed1", 32, "parity", "parity"),  # uncompressed: never the headline
            row("int8", 8, "parity", "parity"), row("int4", 4, "parity", "worse"), row("int2", 2, "worse", None)]
    text = " ".join(fr.headline(rows))
    assert text.startswith("Best setting at parity") and "`int8`" in text and "4.00x at r = 10.0 (2mbit)" in text
    # the fewest-bits parity setting ends just above the target: no speedup for it, the next one's instead
    rows.append({**row("int5", 5, "parity", "parity"), "steps_to_target": None, "base_step_at_this_loss": 997.0})
    text = " ".join(fr.headline(rows))
    assert "`int5`" in text and "never reaches the target" in text and "step 997" in text and "with `int8`" in text
    assert fr.headline([r for r in rows if r["name"] not in ("int8", "int5")]) == ["No compressed setting of the long study is at parity on both rules yet."]


def test_presets_follow_the_committed_frontier():
    """`safe` is the committed frontier's fewest-bits setting at parity on both rules on the real model (SmolLM2-135M)
    with a margin: its loss delta within half the tolerance; `aggressive` is the fewest-bits setting there within the
    loss rule on every seed it ran."""
    import json

    import pp_compress as ppc
    from pp_compress.presets import PRESETS

    rows = json.loads((fr.RESULTS / "frontier.json").read_text())
    parity = sorted((r for r in rows if r.get("model") == "SmolLM2-135M" and r["wire_ratio"] > 1.01 and fr.at_parity(r)
                     and not r["options"] and r["delta"] <= r["tolerance"] / 2), key=lambda r: r["bits_avg"])
    assert parity, "no compressed setting at parity on SmolLM2-135M in results/eval/frontier.json"
    assert ppc.parse_spec(PRESETS["safe"]) == ppc.parse_spec(parity[0]["spec"])
    real = [r for r in rows if r.get("model") == "SmolLM2-135M" and r["wire_ratio"] > 1.01 and not r["options"]]
    by_spec: dict[str, list[dict]] = {}
    for r in real:
        by_spec.setdefault(str(ppc.parse_spec(r["spec"])), []).append(r)
    within = sorted((rs for rs in by_spec.values() if all(r["parity"]["loss_rule"] == "parity" for r in rs)),
                    key=lambda rs: rs[0]["bits_avg"])
    assert str(ppc.parse_spec(PRESETS["aggressive"])) == str(ppc.parse_spec(within[0][0]["spec"]))
    assert len(within[0]) >= 2, "aggressive's loss verdict on SmolLM2 rests on two seeds"
    assert within[0][0]["bits_avg"] < parity[0]["bits_avg"]


def test_a_speedup_from_another_e2e_run_shows_its_own_r():
    assert fr._cell({"speedup": 2.0, "r": 10.1}, 10.0) == "2.00x"  # within 2%: the column's r holds
    assert fr._cell({"speedup": 2.0, "r": 8.0}, 10.0) == "2.00x (r=8.0)"  # machine drift between e2e runs
    assert fr._cell({"speedup": None, "r": 8.0}, 10.0) == "never"


def test_build_keeps_the_other_testbeds_rows(tmp_path, monkeypatch):
    """frontier.json holds both models: rebuilding one testbed replaces its rows and keeps the other's."""
    out = tmp_path / "frontier.json"
    out.write_text(json.dumps([{"name": "sm-base", "model": "SmolLM2-135M"}, {"name": "old", "model": "small GPT"}]))
    monkeypatch.setattr(fr, "load_run", lambda p: _run([(500, 5.0), (1000, 4.0)], 4.0, 4.0) if p.name == "base" else None)
    rows = fr.build(tmp_path, [], out, fr.Testbed("small GPT", {"base": "none"}, "base", "base-seed1", "long"))
    assert [(r["name"], r["model"]) for r in rows] == [("sm-base", "SmolLM2-135M"), ("base", "small GPT")]
    assert json.loads(out.read_text()) == rows and fr.of_model(rows, "SmolLM2-135M")[0]["name"] == "sm-base"


def test_a_testbed_without_link_times_has_a_table(tmp_path, monkeypatch):
    """SmolLM2's rows (no e2e run yet): the baseline is found by its testbed name, and every row has the header's
    cells."""
    runs = {"sm-base": _run([(100, 3.5), (200, 3.3)], 4.0, 4.0), "sm-base-seed1": _run([(100, 3.5), (200, 3.31)], 4.0, 4.0),
            "sm-int8": _run([(100, 3.6), (200, 3.4)], 1.0, 1.0)}
    monkeypatch.setattr(fr, "load_run", lambda p: runs[p.name])
    settings = {"sm-base": "none", "sm-base-seed1": "none", "sm-int8": "int8"}
    rows = fr.build(tmp_path, [], tmp_path / "frontier.json", fr.Testbed("SmolLM2-135M", settings, "sm-base",
                                                                         "sm-base-seed1", "smollm2"))
    lines = fr.table(rows)
    assert [ln.count("|") for ln in lines] == [lines[0].count("|")] * 5
    assert "| sm-int8 | `int8` |" in lines[4] and "+0.100 (0.020) | worse / not run" in lines[4]


def test_lm_eval_verdicts_take_the_most_documents_per_metric_and_the_serving(tmp_path):
    import json

    def report(name, cands):
        (tmp_path / name).write_text(json.dumps({"candidates": [
            {"checkpoint": f"runs/x/{run}", "compress": serve,
             "metrics": {m: {"n": n, "verdict": v} for m, (n, v) in metrics.items()}} for run, serve, metrics in cands]}))
        return tmp_path / name

    short = report("a.json", [("r1", "none", {"acc": (40, "worse"), "bpb": (40, "parity")}),
                              ("r2", "none", {"acc": (40, "parity")}), ("r2", "int8", {"acc": (40, "worse")})])
    full = report("b.json", [("r1", "none", {"acc": (656, "parity")}), ("r2", "none", {"acc": (656, "worse")})])
    assert fr.lm_eval_verdicts([short, full], "none") == {"r1": "parity", "r2": "worse"}
    assert fr.lm_eval_verdicts([short], "none") == {"r1": "worse", "r2": "parity"}
    assert fr.lm_eval_verdicts([short, tmp_path / "missing.json"]) == {"r1": "worse", "r2": "parity"}  # a tie: the first


def test_step_table_gives_each_measured_spec_its_step_times_and_speedups_per_link(tmp_path, monkeypatch):
    """SmolLM2's cosine runs never reach the strict target, so the step-time table carries the link comparison:
    the uncompressed run's step time over the setting's, per link; one row per spec (a second seed shares it)."""
    runs = {"sm-base": _run([(100, 3.5), (200, 3.3)], 4.0, 4.0), "sm-base-seed1": _run([(100, 3.5), (200, 3.31)], 4.0, 4.0),
            "sm-int8": _run([(100, 3.6), (200, 3.305)], 1.0, 1.0), "sm-int8-seed1": _run([(100, 3.6), (200, 3.306)], 1.0, 1.0),
            "sm-int2": _run([(100, 3.6), (200, 3.4)], 0.25, 0.25)}
    monkeypatch.setattr(fr, "load_run", lambda p: runs[p.name])
    settings = {"sm-base": "none", "sm-base-seed1": "none", "sm-int8": "int8", "sm-int8-seed1": "int8", "sm-int2": "int2"}
    e2e = tmp_path / "e2e.csv"  # benchmarks/e2e.py's columns that the frontier reads
    e2e.write_text("mode,link,rate_mbit,latency_ms,spec,step_s\n" + "\n".join(
        f"netns,{link},{rate},{lat},{spec},{t}" for link, rate, lat, spec, t in
        [("none", 0, 0, "none", 10.0), ("none", 0, 0, "int8", 10.5), ("5mbit", 5, 20, "none", 40.0),
         ("5mbit", 5, 20, "int8", 16.0)]) + "\n")
    rows = fr.build(tmp_path, [e2e], tmp_path / "frontier.json",
                    fr.Testbed("SmolLM2-135M", settings, "sm-base", "sm-base-seed1", "smollm2"))
    by = {r["name"]: r for r in rows}
    assert by["sm-int8"]["steps_to_target"] is None and by["sm-int8"]["links"]["5mbit"]["speedup"] is None
    assert by["sm-int8"]["links"]["5mbit"]["step_speedup"] == pytest.approx(2.5)
    lines = fr.step_table(rows)
    assert lines[0] == ("| setting | --pp-compress | parity: loss / lm-eval | unlimited: step s (speedup) | "
                        "5mbit (r=3.0): step s (speedup) |")
    assert lines[2:] == ["| sm-base | `none` | parity / baseline | 10.00 (1.00x) | 40.00 (1.00x) |",
                         "| sm-int8 | `int8` | parity / not run | 10.50 (0.95x) | 16.00 (2.50x) |"]


def test_a_reports_per_document_values_are_not_read_as_a_report(tmp_path, monkeypatch):
    """eval/parity.py writes <out>.json and <out>.docs.json; a testbed's `parity_*.json` pattern matches both."""
    runs = {"sm-base": _run([(100, 3.5), (200, 3.3)], 4.0, 4.0), "sm-int8": _run([(100, 3.5), (200, 3.3)], 1.0, 1.0)}
    monkeypatch.setattr(fr, "load_run", lambda p: runs.get(p.name))
    (tmp_path / "parity_int8.json").write_text(json.dumps({"candidates": [
        {"checkpoint": "runs/x/sm-int8", "compress": "none", "metrics": {"acc": {"n": 40, "verdict": "parity"}}}]}))
    (tmp_path / "parity_int8.docs.json").write_text(json.dumps({"candidates": [
        {"checkpoint": "runs/x/sm-int8", "compress": "none", "values": {"t": {"acc": [1.0, 0.0]}}}]}))
    rows = fr.build(tmp_path, [], tmp_path / "frontier.json", fr.Testbed(
        "SmolLM2-135M", {"sm-base": "none", "sm-int8": "int8"}, "sm-base", "sm-base-seed1", "smollm2", ("parity_*.json",)))
    assert {r["name"]: r["parity"]["lm_eval"] for r in rows}["sm-int8"] == "parity"
