"""What was measured for a setting: its recorded verdicts (presets.VERDICTS), matched by the parsed spec, and the note
the recipes print before a run of a setting measured worse on the model in use."""
from __future__ import annotations

from typing import Any

from .config import parse_spec
from .presets import PRESETS, VERDICTS, Verdict


def verdicts(cfg: Any, model: str | None = None) -> list[Verdict]:
    """The verdicts of a setting (a CompressionConfig or a spec string), on one model or on all."""
    key = str(parse_spec(cfg) if isinstance(cfg, str) else cfg)
    return [v for v in VERDICTS if str(parse_spec(v.spec)) == key and model in (None, v.model)]


def advice(cfg: Any, model: str | None) -> str | None:
    """A one-time note for a run of `cfg` on `model`: what was measured, when that setting was worse than uncompressed
    by the loss rule there, and the preset to use instead; None otherwise (at parity, or never measured)."""
    if model is None:
        return None
    bad = [v for v in verdicts(cfg, model) if v.loss_rule == "worse"]
    if not bad:
        return None
    safe = verdicts("safe", model)[0]
    return (f"{cfg} was measured worse than uncompressed ({bad[0].line()}; {bad[0].evidence}). "
            f"'safe' ({PRESETS['safe']}) is at parity there: {safe.line()}.")
