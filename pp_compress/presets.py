"""Named settings: `--pp-compress safe`, `"pp_compress": "safe"`, or `safe,warmup=100` with more keys after it.

Each preset is a spec string chosen from the measured frontier of the long quality study (eval/results/frontier.json;
the evidence, with numbers, is in the README's "Presets" section and eval/RESULTS.md). A preset is only a name for a
spec: `str(parse_spec("safe"))` is the spec it stands for, so logs and checkpoints record what actually ran.
"""
from __future__ import annotations

PRESETS: dict[str, str] = {
    # the setting with the fewest bits that is at parity on both rules (final loss within the seed noise floor, and
    # lm-eval non-inferiority) on the small GPT; tests/eval/test_frontier.py holds it to the committed frontier. On
    # SmolLM2-135M it fails the loss rule (README "Which setting"): it changes once a setting is at parity on both
    "safe": "act=nf6,grad=int3:stoch",
    # fewer bits again, at a measured quality cost (README "Presets" states it); for links where bytes dominate
    "aggressive": "act=nf5,grad=nf2:stoch",
}


def expand(items: list[str]) -> list[str]:
    """Replace a leading preset name by its spec's items; other items pass through."""
    if items and items[0] in PRESETS:
        return [t.strip() for t in PRESETS[items[0]].split(",")] + items[1:]
    return items
