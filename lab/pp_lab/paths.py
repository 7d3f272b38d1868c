"""Where the lab finds the checkout it runs from: the lab is installed editable (`pip install -e ".[lab]"`) from this
repository, and its commands read the shipped configs and write the committed results tree."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (the folder holding pyproject.toml)."""
CONFIGS = ROOT / "deepspeed_configs"
"""The ready DeepSpeed configs that the recipes use when no --deepspeed_config is given."""
RESULTS = ROOT / "results" / "eval"
"""The quality studies' committed logs, reports and frontier (data only: nothing reads it to decide at run time)."""
BENCH = ROOT / "results" / "bench"
"""The benchmarks' committed tables and CSVs."""
PLOTS = ROOT / "results" / "plots"
"""The committed figures."""
