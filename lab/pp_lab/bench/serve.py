"""Serving speed over slow links: KV-cached pipelined generation (recipes/infer.py) with and without compression.

    python benchmarks/serve.py        # as root -> results/bench/serve_smollm2.md / .csv (about an hour on 2 cores)
    python benchmarks/serve.py --link 5mbit@20ms --stages 2 --batch 1 --spec none --spec int8:rot --new 16
    python benchmarks/serve.py --keep-blocks 4 --stages 4 --out results/bench/serve_smollm2_blocks4

For each link, stage count and batch size, every spec generates --new greedy tokens after the same prompts of
--prompt-tokens tokens (held-out text of --corpus), all in this one invocation so the runs compare side by side.
Each stage process runs in a network namespace of its own behind a kernel rate limit (benchmarks/e2e.py's
`Namespaces`); a message's one-way latency is added by its sender (benchmarks/throttle.py with PPC_BENCH_P2P=torch:
every hidden state sent to the next stage, and every new token broadcast back from the last stage). Where
namespaces are not permitted the whole link is emulated in-process and the rows say so.

Reported per run: time to first token (the prompt lengths announced, prefill across every boundary, the first token
back), decode tokens/s over the batch (the later tokens), and where the time went, summed over the stage processes:
compute, wire (send/receive, including waiting for the previous stage) and (de)compression. min_numel=0 is added to
every compressed spec so that batch-1 decode messages (one position) are compressed too.

--keep-blocks N serves a copy of the model with only its first N transformer blocks: the same hidden states on the
wire (width, dtype, messages) with N/L of the compute, which is what the link's share of the time would be on a
machine that computes L/N times faster than this CPU (a GPU). Its tokens are not the model's; only speed is measured.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
import time
from pathlib import Path

from pp_lab.paths import ROOT
from pp_lab.bench.e2e import BUCKET, Namespaces, netns_permitted, run_throttled, shaped_links
from pp_lab.bench.throttle import parse_link
from pp_lab import data

SPECS = ["none", "int8", "int8:rot", "int4:rot"]


def prompts(checkpoint: Path, corpus: str, n: int, tokens: int) -> tuple[list[str], list[int]]:
    """n held-out texts of `tokens` tokens each (one per line) and their lengths once re-tokenized."""
    from pp_lab.kvcache import load_model

    _, tok, _ = load_model(checkpoint)
    val = data.lm_datasets(data.corpus_files(corpus), tok, tokens, data.VAL_FRACTION)[1]
    if len(val) < n:
        raise SystemExit(f"--batch {n}: the held-out text of {corpus} has {len(val)} sequences of {tokens} tokens")
    texts = [tok.decode(val[i]["input_ids"]).replace("\n", " ") for i in range(n)]
    return texts, [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def first_blocks(checkpoint: Path, n: int, where: Path) -> Path:
    """A transformers folder with the first n blocks of `checkpoint`'s (its embedding, final norm and head kept)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((checkpoint / "config.json").read_text()) if (checkpoint / "config.json").exists() else None
    if cfg is None or "num_hidden_layers" not in cfg:
        raise SystemExit(f"--keep-blocks: {checkpoint} is not a transformers folder with num_hidden_layers in its config.json")
    if not 1 <= n <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--keep-blocks {n}: {checkpoint.name} has {cfg['num_hidden_layers']} blocks; accepted: 1 to that")
    out = where / f"{checkpoint.name}-blocks{n}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    keep = lambda k: not k.startswith("model.layers.") or int(k.split(".")[2]) < n  # noqa: E731
    state = {k: v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(f).items() if keep(k)}
    for f in checkpoint.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n}, indent=1))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run(ns: Namespaces | None, stages: int, args: list[str], env: dict[str, str]) -> dict:
    out = Path(args[args.index("--out") + 1])
    rc, log = run_throttled(ns, stages, ROOT / "recipes" / "infer.py", args, env, 3600)
    if rc != 0:
        raise SystemExit(f"recipes/infer.py {shlex.join(args)}: exit {rc}\n{log[-4000:]}")
    return json.loads(out.read_text())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct",
                    help="a recipe run or a transformers folder (default: SmolLM2 from `make models`)")
    ap.add_argument("--corpus", default="austen", choices=list(data.CORPORA))
    ap.add_argument("--link", type=parse_link, action="append", default=None, help="default: 5mbit@20ms")
    ap.add_argument("--stages", type=int, action="append", default=None, help="default: 2 and 4")
    ap.add_argument("--batch", type=int, action="append", default=None, help="sequences per batch; default: 1 and 16")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--spec", action="append", default=None, help=f"default: {' '.join(SPECS)}")
    ap.add_argument("--keep-blocks", type=int, default=None,
                    help="serve the model's first N blocks only: the same traffic with a faster machine's share of compute")
    ap.add_argument("--emulate", action="store_true", help="in-process link emulation even where namespaces work")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "serve")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "serve_smollm2")
    ap.add_argument("--rewrite", action="store_true", help="only rewrite <out>.md from <out>.csv (keeps its command)")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.rewrite:
        return rewrite(args)
    links, specs = args.link or [parse_link("5mbit@20ms")], args.spec or SPECS
    stage_counts, batches = args.stages or [2, 4], args.batch or [1, 16]
    if "none" not in specs:
        raise SystemExit("--spec none is needed: every speedup is against the uncompressed run of the same setting")
    why_not = "--emulate given" if args.emulate else netns_permitted()
    mode = "netns+tbf" if why_not is None else "emulated"
    if why_not:
        print(f"WARNING: network namespaces not used ({why_not}): links are EMULATED in-process", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint if args.keep_blocks is None else first_blocks(args.checkpoint, args.keep_blocks, args.work)
    texts, lens = prompts(checkpoint, args.corpus, max(batches), args.prompt_tokens)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PPC_BENCH_P2P": "torch"}
    results: list[dict] = []
    for stages in stage_counts:
        for ns, (name, rate, latency), lenv in shaped_links(stages, links, mode == "netns+tbf", env):
            for b in batches:
                pfile = args.work / f"prompts_{b}.txt"
                pfile.write_text("\n".join(texts[:b]) + "\n")
                for spec in specs:
                    t0 = time.perf_counter()
                    out = args.work / f"result_{stages}_{b}.json"
                    res = run(ns, stages, ["--checkpoint", str(checkpoint), "--prompt-file", str(pfile),
                                           "--max-new-tokens", str(args.new), "--stages", str(stages),
                                           "--pp-compress", spec if spec == "none" else f"{spec},min_numel=0",
                                           "--out", str(out)], lenv)
                    row = summarize(res, mode, name, rate, latency, stages, b, spec, sum(lens[:b]) / b)
                    base = next((r for r in results if (r["link"], r["stages"], r["batch"], r["spec"]) ==
                                 (name, stages, b, "none")), None)
                    row["ttft_speedup"] = base["ttft_s"] / row["ttft_s"] if base else None
                    row["decode_speedup"] = row["decode_tok_s"] / base["decode_tok_s"] if base else None
                    results.append(row)
                    print(f"{name} {stages} stages batch {b:2d} {spec:10s} TTFT {row['ttft_s']:7.2f} s  decode "
                          f"{row['decode_tok_s']:6.1f} tok/s  ({time.perf_counter() - t0:.0f} s)", flush=True)
    write(results, args, mode)


def summarize(res: dict, mode: str, link: str, rate: float, latency: float, stages: int, batch: int, spec: str,
              prompt_tokens: float) -> dict:
    per = res["per_stage"]
    traffic = {ph: [sum(s["traffic"][ph][i] for s in per) for i in range(3)] for ph in ("prefill", "decode")}
    return {"mode": mode, "link": link, "rate_mbit": rate, "latency_ms": latency, "stages": stages, "batch": batch,
            "spec": spec, "prompt_tokens": prompt_tokens, "ttft_s": res["time_to_first_token_s"],
            "decode_tok_s": res["decode_tokens_per_s"], "total_s": res["total_s"],
            **{f"{k}_s": sum(s["timings"][k] for s in per) for k in ("compute", "wire", "codec")},
            "prefill_wire_mb": traffic["prefill"][1] / 1e6, "decode_wire_mb": traffic["decode"][1] / 1e6,
            "prefill_bits": 8 * traffic["prefill"][1] / max(traffic["prefill"][2], 1),
            "decode_bits": 8 * traffic["decode"][1] / max(traffic["decode"][2], 1)}


def link_s(r: dict) -> float:
    """Seconds the prefill's bytes need on the link alone: each boundary in turn (the prompt's hidden states cross
    them one after another), at the link's rate, plus one latency per message: the two that announce the prompt
    lengths, one per hop, and the first token coming back."""
    rate = r["rate_mbit"] * 1e6 / 8
    return (r["prefill_wire_mb"] * 1e6 / rate if rate else 0.0) + (r["stages"] + 2) * r["latency_ms"] / 1e3


def rewrite(args: argparse.Namespace) -> None:
    """<out>.md again from <out>.csv, for the command recorded in it (the runs' own options)."""
    with open(args.out.with_suffix(".csv")) as f:
        rows = [{k: (None if v == "" else v if k in ("mode", "link", "spec") else float(v)) for k, v in r.items()}
                for r in csv.DictReader(f)]
    for r in rows:
        r["stages"], r["batch"] = int(r["stages"]), int(r["batch"])
    command = args.out.with_suffix(".md").read_text().split("Command: `", 1)[1].split("`", 1)[0]
    ran = parser().parse_args(shlex.split(command)[2:])
    ran.out = args.out
    write(rows, ran, str(rows[0]["mode"]), command)


TABLE_HEAD = "| link | stages | batch |"


def table(results: list[dict]) -> list[str]:
    lines = [f"{TABLE_HEAD} --pp-compress | bits/elem prefill | bits/elem decode | time to first token s | "
             "prefill on the link s | TTFT speedup | decode tokens/s | decode speedup | compute s | wire s | "
             "(de)compression s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        link = "unlimited" if r["rate_mbit"] == 0 else f"{r['link']} @ {r['latency_ms']:g} ms"
        sp = (lambda v: f"{v:.2f}x" if v else "")
        lines.append(f"| {link} | {r['stages']} | {r['batch']} | `{r['spec']}` | {r['prefill_bits']:.2f} | "
                     f"{r['decode_bits']:.2f} | {r['ttft_s']:.2f} | {link_s(r):.2f} | {sp(r['ttft_speedup'])} | "
                     f"{r['decode_tok_s']:.1f} | {sp(r['decode_speedup'])} | {r['compute_s']:.1f} | {r['wire_s']:.1f} | "
                     f"{r['codec_s']:.2f} |")
    return lines


def write(results: list[dict], args: argparse.Namespace, mode: str, command: str | None = None) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(results[0]))
        w.writeheader()
        w.writerows(results)
    command = command or shlex.join(["python", "benchmarks/serve.py", *sys.argv[1:]])
    how = (f"kernel tbf rate limits between per-stage network namespaces ({BUCKET}), latency added by each message's "
           "sender"
           if mode == "netns+tbf" else "EMULATED in-process: the sender sleeps latency + bytes/rate per message")
    blocks = f", its first {args.keep_blocks} blocks" if args.keep_blocks is not None else ""
    lines = [f"# Serving over slow links: {args.checkpoint.name}{blocks}", "",
             f"Command: `{command}`", "",
             f"KV-cached pipelined generation (recipes/infer.py), greedy, {args.new} new tokens after prompts of "
             f"~{results[0]['prompt_tokens']:.0f} tokens (held-out {args.corpus}), fp32 hidden states, one CPU thread per "
             f"stage process on a 2-core machine (stage processes share the cores), CPU/gloo; links: {how}. Time spent "
             "is summed over the stage processes (wire includes waiting for the previous stage). Prefill on the link: "
             "what the prefill's bytes need at the link's rate, boundary after boundary, plus one latency per message "
             "(two announce the prompt lengths, one per hop, one brings the first token back): the part of the time to "
             "first token that compression can shrink.",
             *(["", f"Only the first {args.keep_blocks} blocks of {args.checkpoint.name} run "
                "(`--keep-blocks`): the same messages on the wire with a fraction of the compute, as on a machine that "
                "computes that much faster. The tokens are not the model's; only the speed is measured."]
               if args.keep_blocks is not None else []),
             "", *table(results)]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
