"""Messages as untrusted input: every registered operator's decoder fed malformed buffers of the right size.

    python benchmarks/fuzz.py                                  # 10,000 buffers per spec, results/bench/fuzz.md
    bash benchmarks/sanitize.sh                                # the same with the C++ kernels under AddressSanitizer

For each spec (each operator's first examples, and the presets' operators) it packs a real tensor, then decodes
`--buffers` malformed copies of the message through `Codec.unpack`, the receiver's path:
- `random`: uniformly random bytes;
- `flips`: the real message with 1 to 8 random bytes replaced;
- `fields`: the real message with random elements of one of its tensors (scales, codes, indices) set to extreme
  values (NaN, +-Inf, +-3e38, 0 and -1 for floats; the type's largest values for integers).
Each outcome is one of: `rejected` (a ValueError or FloatingPointError that names the boundary and says the message
is corrupt), `finite` (a finite tensor of the right shape and dtype: the format cannot tell), or `wrong` (anything
else: a raw error, a NaN/Inf returned, a wrong shape). A crash ends the process: under AddressSanitizer an
out-of-bounds access in a C++ kernel is one. The table counts the outcomes per spec; the run fails if any is wrong.
"""
from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

import pp_compress as ppc
from pp_compress.ops import op_configs
from pp_lab.paths import BENCH

PRESET_OPS = ["int8:rot", "vq:4", "vq:3", "int3:stoch", "nf6", "topk:0.1>int8", "topk:0.1+ef"]
KINDS = ("random", "flips", "fields")
FLOAT_EXTREMES = (float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 0.0, -1.0)


def specs(per_op: int) -> list[str]:
    """The first `per_op` examples of every registered operator, then the presets' operators."""
    out = [spec for cls in op_configs() for spec in cls.EXAMPLES[:per_op]]
    return list(dict.fromkeys(out + PRESET_OPS))


def malformed(kind: str, good: torch.Tensor, layout: list, rng: random.Random) -> torch.Tensor:
    """One malformed copy of the message `good` (a flat uint8 buffer laid out as `layout`)."""
    n = good.numel()
    if kind == "random":
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.getrandbits(62)))
    bad = good.clone()
    if kind == "flips":
        for _ in range(rng.randint(1, 8)):
            bad[rng.randrange(n)] = rng.randrange(256)
        return bad
    offsets, start = [], 0
    for spec in layout:  # the byte range of each tensor of the message
        offsets.append((start, spec))
        start += spec.nbytes
    candidates = [(o, s) for o, s in offsets if s.numel]
    offset, spec = rng.choice(candidates)
    view = bad[offset:offset + spec.nbytes].view(spec.dtype)  # the tensor as it travels
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(view.numel())
        if spec.dtype.is_floating_point:
            view[i] = rng.choice(FLOAT_EXTREMES)
        else:
            info = torch.iinfo(spec.dtype)
            view[i] = rng.choice((info.max, info.min, info.max - 1))
    return bad


def outcome(codec: ppc.Codec, buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    try:
        y = codec.unpack(buf, shape, dtype, step=3)
    except (ValueError, FloatingPointError) as e:
        text = str(e)
        return "rejected" if text.startswith("boundary0.act: ") and "corrupt" in text else f"wrong: {text[:160]}"
    except Exception as e:  # noqa: BLE001 - anything else is what this benchmark looks for
        return f"wrong: {type(e).__name__}: {str(e)[:160]}"
    if tuple(y.shape) != shape or y.dtype != dtype:
        return f"wrong: shape {tuple(y.shape)} {y.dtype}"
    return "finite" if bool(torch.isfinite(y).all()) else "wrong: NaN/Inf returned"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffers", type=int, default=10000, help="malformed buffers per spec")
    ap.add_argument("--per-op", type=int, default=2, help="examples taken from each registered operator")
    ap.add_argument("--spec", action="append", default=None, help="these specs instead")
    ap.add_argument("--shape", default="2x16x576", help="BxSxH of the tensor sent")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=BENCH / "fuzz.md")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split("x"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rng = random.Random(args.seed)
    rows, wrong = [], []
    for spec in args.spec or specs(args.per_op):
        send, recv = ppc.Codec(f"act={spec}"), ppc.Codec(f"act={spec}")  # (mdtopk learns on activations only)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rng.getrandbits(62))).to(dtype)
        good, _ = send.pack(x, step=3)
        layout = recv.op.wire_layout(shape, dtype, recv.policy.context(recv.where))
        counts: Counter = Counter()
        for i in tqdm(range(args.buffers), desc=f"{spec:24s}", leave=False, mininterval=5):
            got = outcome(recv, malformed(KINDS[i % len(KINDS)], good, layout, rng), shape, dtype)
            counts[got if not got.startswith("wrong") else "wrong"] += 1
            if got.startswith("wrong") and len(wrong) < 50:
                wrong.append(f"`{spec}` ({KINDS[i % len(KINDS)]}): {got[7:]}")
        rows.append(f"| `{spec}` | {good.numel()} | {counts['rejected']} | {counts['finite']} | {counts['wrong']} |")
        print(rows[-1], flush=True)
    kernels = os.environ.get("PP_COMPRESS_KERNELS", "native")
    asan = "libasan" in Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else False
    lines = [f"Command: `{os.environ.get('FUZZ_PREFIX', '')}python benchmarks/fuzz.py "
             f"{' '.join(map(shlex.quote, sys.argv[1:]))}`", "",
             f"torch {torch.__version__}, CPU kernels `PP_COMPRESS_KERNELS={kernels}` (AddressSanitizer "
             f"{'loaded' if asan else 'not loaded'}); a {args.dtype} tensor of "
             f"{args.shape} sent, {args.buffers} malformed messages per spec, kinds in turn: {', '.join(KINDS)}.", "",
             "| spec | message bytes | rejected by name | decoded finite | wrong |", "|---|---|---|---|---|", *rows]
    if wrong:
        lines += ["", "Wrong outcomes (first 50):", "", *[f"- {w}" for w in wrong]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    if wrong:
        raise SystemExit(f"{sum(1 for _ in wrong)}+ malformed messages were not rejected by name nor decoded finite")


if __name__ == "__main__":
    main()
