"""lab/pp_lab/eval/epochs.py: traffic split at the end of the first epoch, the loss rule, argument checks."""
from __future__ import annotations

import math

import pytest

from pp_lab.eval import epochs
from pp_lab.eval.study import FT_EP_COMMON

ARGS = ["--train-sequences", "8", "--micro-batch", "2", "--grad-accum", "2", "--log-every", "1"]  # 2 steps an epoch


def run(spec: str, act_wire: list[float], val: float, evals: tuple[float, ...] = ()) -> dict:
    train = [{"step": i, "loss": 2.0, "act_raw_bytes": 100.0, "act_wire_bytes": w, "grad_raw_bytes": 100.0,
              "grad_wire_bytes": 25.0} for i, w in enumerate(act_wire, 1)]
    return {"spec": spec, "train": train, "val_loss": val, "steps": len(act_wire),
            "evals": [{"val_loss": v} for v in (*evals, val)]}


def test_first_epoch_raw_later_epochs_compressed() -> None:
    runs = {"base": run("none", [100.0] * 6, 3.2, (2.9,)),  # overfits: best 2.9 after the first epoch
            "aq": run("act=int4+aqsgd", [100.0, 100.0, 12.5, 12.5, 12.5, 12.5], 3.01, (2.91,)),
            "bad": run("act=int2", [6.25] * 6, 3.0, (2.95,))}  # ends lower than base, but its best is 0.05 worse
    rows = {r["name"]: r for r in epochs.rows(runs, {"base": "", "aq": "", "bad": "", "not-run": ""}, "base", ARGS)}
    assert list(rows) == ["base", "aq", "bad"]
    aq = rows["aq"]
    assert (aq["bits_act_first"], aq["bits_act_later"], aq["bits_grad_first"]) == (32.0, 4.0, 8.0)
    assert aq["epochs"] == 3 and aq["best_val_loss"] == 2.91 and aq["delta"] == pytest.approx(0.01)
    assert [rows[n]["loss_rule"] for n in rows] == ["baseline", "parity", "worse"]  # best val; 0.02-nat floor
    text = "\n".join(epochs.table(list(rows.values()), "base"))
    # over the run: activations (32 + 2 x 4) / 3 epochs, gradients 8, averaged
    assert epochs.run_bits(aq) == pytest.approx(((32 + 2 * 4) / 3 + 8) / 2)
    assert "| aq | `act=int4+aqsgd` | 32.00 / 8.00 | 4.00 / 8.00 (6.00) | 10.67 | 2.910 | +0.010 | 3.010 | 2.000 | parity |" in text


def test_no_baseline_no_verdict_and_argument_checks() -> None:
    rows = epochs.rows({"aq": run("x", [1.0, 1.0], 3.0)}, {"aq": ""}, "base", ARGS)
    assert rows[0]["delta"] is None and rows[0]["loss_rule"] is None and math.isnan(rows[0]["bits_act_later"])
    with pytest.raises(ValueError, match="--log-every 3 must divide the epoch"):
        epochs.rows({}, {}, "base", ARGS[:-1] + ["3"])
    with pytest.raises(ValueError, match="not a whole number of steps"):
        epochs.steps_per_epoch(["--train-sequences", "7", "--micro-batch", "2", "--grad-accum", "2"])
    with pytest.raises(KeyError, match="--log-every is not among"):
        epochs.flag(["--steps", "1"], "--log-every")


def test_the_study_protocol_splits_cleanly() -> None:
    assert epochs.steps_per_epoch(FT_EP_COMMON) == 8  # 32 sequences, 4 a step
    assert epochs.steps_per_epoch(FT_EP_COMMON) % int(epochs.flag(FT_EP_COMMON, "--log-every")) == 0
