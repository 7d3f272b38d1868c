"""In-process demo: a tiny GPT-2 trained with compression at three simulated stage boundaries.

Each spec trains the same model from the same seed on the same batches, so the losses compare
directly. Text: the docstrings of Python's standard library (English prose that every machine has;
nothing is downloaded), byte-level tokens. Metrics go to <out>/<spec>.jsonl, one line per step.

    python recipes/demo_inprocess.py --steps 300 --spec identity --spec "act=int8,grad=int8"
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

import pp_compress as ppc

DEFAULT_SPECS = ["identity", "act=int8,grad=int8", "act=topk:0.1,grad=topk:0.1", "act=topk:0.1,grad=topk:0.1+ef"]


def stdlib_text(limit: int = 2_000_000) -> bytes:
    """Docstrings of the standard library's modules, classes and functions."""
    parts: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
            if info.name.startswith("_") or "site-packages" in str(getattr(info.module_finder, "path", "")):
                continue
            if info.name in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "pydoc_data"}:
                continue
            try:
                mod = importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - some stdlib modules need absent C libraries
                continue
            for obj in [mod, *vars(mod).values()]:
                doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj)) else None
                if doc and len(doc) > 80:
                    parts.append(doc)
            if sum(map(len, parts)) > limit:
                break
    return "\n\n".join(dict.fromkeys(parts)).encode("ascii", "ignore")[:limit]


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (steps, batch), generator=g)
    return [torch.stack([data[s : s + seq] for s in row.tolist()]) for row in starts]


def run(spec: str, data: torch.Tensor, held: torch.Tensor, args: argparse.Namespace) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=args.width, n_head=4, vocab_size=256,
                                       n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    bounds = ppc.insert_boundaries(model, after=[0, 1, 2], cfg=spec)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train = batches(data, args.steps, args.batch, args.seq, args.seed)
    log = (args.out / f"{spec.replace('/', '_')}.jsonl").open("w")
    t0 = time.time()
    bar = tqdm(train, desc=f"{spec:<34}", ncols=110, leave=True)
    for step, x in enumerate(bar):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.write(json.dumps({"step": step, "loss": loss.item(), **{f"b{b.boundary}.{d}.ratio": round(b.stats[d].ratio, 3)
                                                                     for b in bounds for d in ("act", "grad")}}) + "\n")
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        val = sum(model(x, labels=x).loss.item() for x in held) / len(held)
    log.close()
    return {"spec": spec, "train_loss": loss.item(), "val_loss": val, "seconds": time.time() - t0, "bounds": bounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", help="pp_compress spec (repeatable); default: a comparison of five")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    args = ap.parse_args()
    specs = args.spec or DEFAULT_SPECS
    for s in specs:
        ppc.parse_spec(s)  # fail before any work on a bad spec
    args.out.mkdir(parents=True, exist_ok=True)
    text = stdlib_text()
    data = torch.tensor(list(text), dtype=torch.long)
    cut = int(data.numel() * 0.95)
    held = batches(data[cut:], 8, args.batch, args.seq, seed=12345)
    print(f"corpus: {len(text) / 1e6:.2f} MB of stdlib docstrings, byte tokens; model: GPT-2 4 x {args.width}, "
          f"boundaries after blocks 0, 1, 2; {args.steps} steps of {args.batch} x {args.seq}")
    results = [run(s, data[:cut], held, args) for s in specs]
    print(f"\n{'spec':<36} {'train':>7} {'val':>7} {'act ratio':>10} {'grad ratio':>11} {'act err':>8} {'grad err':>9} {'sec':>6}")
    for r in results:
        acts = [b.stats["act"] for b in r["bounds"]]
        grads = [b.stats["grad"] for b in r["bounds"]]
        ratio = lambda ss: sum(s.raw_bytes for s in ss) / sum(s.wire_bytes for s in ss)  # noqa: E731
        err = lambda ss: sum(s.rel_error for s in ss) / len(ss)  # noqa: E731
        print(f"{r['spec']:<36} {r['train_loss']:>7.3f} {r['val_loss']:>7.3f} {ratio(acts):>10.2f} {ratio(grads):>11.2f} "
              f"{err(acts):>8.3f} {err(grads):>9.3f} {r['seconds']:>6.1f}")
    print("\nper boundary (last spec):")
    print(ppc.stats.format_table({f"b{b.boundary}.{d}": b.stats[d] for b in results[-1]["bounds"] for d in ("act", "grad")}))
    print(f"\nper-step logs: {args.out}/*.jsonl")


if __name__ == "__main__":
    main()
