"""pp_compress.presets and pp_compress.advice: every recorded verdict is the committed frontier's, and the advice follows the verdicts."""
import json
from pathlib import Path

import pytest

from pp_compress import parse_spec
from pp_compress.advice import advice, verdicts
from pp_compress.presets import PRESETS, VERDICTS, Verdict

FRONTIER = Path(__file__).resolve().parents[2] / "results" / "eval" / "frontier.json"


@pytest.mark.parametrize("v", VERDICTS, ids=lambda v: f"{v.spec}|{v.model}|{v.seed}")
def test_every_verdict_is_the_committed_frontiers(v):
    rows = [r for r in json.loads(FRONTIER.read_text()) if r["model"] == v.model and r["seed"] == v.seed
            and not r["options"] and str(parse_spec(r["spec"])) == str(parse_spec(v.spec))]
    assert len(rows) == 1, f"{v.spec} on {v.model} (seed {v.seed}): {len(rows)} frontier rows"
    r = rows[0]
    assert (round(r["bits_avg"], 2), round(r["delta"], 3), round(r["tolerance"], 3)) == (v.bits, v.delta, v.tolerance)
    assert (r["parity"]["loss_rule"], r["parity"]["lm_eval"]) == (v.loss_rule, v.lm_eval)
    assert (FRONTIER.parents[2] / v.evidence).is_dir()


def test_every_preset_is_at_parity_by_the_loss_rule_on_every_model_it_was_judged_on():
    for name, spec in PRESETS.items():
        judged = verdicts(name)
        assert {v.model for v in judged} == {"small GPT", "SmolLM2-135M"}, name
        assert all(v.loss_rule == "parity" for v in judged), name
    safe = verdicts("safe", "SmolLM2-135M")
    assert [(v.loss_rule, v.lm_eval) for v in safe] == [("parity", "parity")]


def test_advice_names_the_measurement_and_safe_for_a_setting_measured_worse():
    note = advice(parse_spec("topk:0.1"), "small GPT")
    assert note.startswith("act=topk:0.1,grad=topk:0.1 was measured worse than uncompressed (small GPT: 4.20 bits/element, "
                           "final loss "
                           "+1.679 (tolerance 0.063)")
    assert "'safe' (int8:rot) is at parity there: small GPT: 8.08 bits/element" in note
    note = advice(parse_spec("act=nf6,grad=int3:stoch"), "SmolLM2-135M")  # at parity on the small GPT, worse here
    assert "SmolLM2-135M: 4.53 bits/element, final loss +0.025" in note
    assert advice(parse_spec("act=nf6,grad=int3:stoch"), "small GPT") is None
    assert advice(parse_spec("safe"), "SmolLM2-135M") is None and advice(parse_spec("int8"), "small GPT") is None
    assert advice(parse_spec("int8:per=block32"), "small GPT") is None  # never measured: nothing to say
    assert advice(parse_spec("topk:0.1"), None) is None  # a model the studies did not measure


def test_a_verdict_that_contradicts_its_numbers_is_refused():
    with pytest.raises(ValueError, match=r"delta \+0.050 against tolerance 0.020 is not 'parity'"):
        Verdict("int8", "SmolLM2-135M", 8.0, 0.05, 0.02, "parity", None, "x")
    with pytest.raises(ValueError, match="model='GPT-2'; accepted: small GPT, SmolLM2-135M"):
        Verdict("int8", "GPT-2", 8.0, 0.0, 0.02, "parity", None, "x")


@pytest.mark.parametrize("name", ["cpu_gloo.json", "gpu_nccl.json"])
def test_the_shipped_deepspeed_configs_run_safe(name):
    from pp_compress import CompressionConfig

    section = json.loads((FRONTIER.parents[2] / "deepspeed_configs" / name).read_text())["pp_compress"]
    assert str(CompressionConfig.from_dict(section)) == str(parse_spec("safe"))
