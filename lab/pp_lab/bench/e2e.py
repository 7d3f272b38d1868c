"""End-to-end speed: the pretraining recipe's pipeline over rate-limited links, with and without compression.

    python benchmarks/e2e.py        # as root -> results/bench/e2e.md, e2e.csv, e2e.png (about 15 min)
    python benchmarks/e2e.py --link 100mbit --link none --spec none --spec int8 --steps 8
    python benchmarks/e2e.py --link 25mbit@5ms --model tiny -- --corpus fixture --seq-len 64
    python benchmarks/e2e.py --link 25mbit --spec none --spec 'none --subspace 12' --spec 'int8 --subspace 12' 

Links. Every stage process runs in a network namespace of its own, joined to a bridge (in a namespace
too) by a veth pair. A kernel token-bucket filter (`tc qdisc ... tbf`) limits both ends of each veth to
the link's rate: what a stage sends leaves through its own limited "NIC" and enters its neighbour through
the neighbour's. gloo runs over these links (GLOO_SOCKET_IFNAME). Addresses are in 198.18.0.0/24 (RFC
2544's benchmarking range); they exist only inside these namespaces and nothing routes out. The
namespaces are torn down on exit, also after errors. Latency: this kernel has no netem, so a link's
one-way latency is added by the sending process before each pipeline message (benchmarks/throttle.py).
Where namespaces are not permitted (not root, no `ip`), the script says so and emulates the whole link
in-process (sleep per message); every row then says "emulated".

Runs. For each link, for each spec: `recipes/pretrain.py --stages N --model small` (or, with `--recipe finetune`,
SmolLM2-135M through `recipes/finetune.py`) for --steps steps (by default micro-batch 4 x seq 128, 4 micro-batches
per step, fp32), all in this one invocation so the runs compare
side by side. Step time is the mean of each run's steps after the first two (start-up); tokens/s
follows from it; speedup is uncompressed step time / this step time on the same link. Wire bytes per
step are pp_compress's counters (all boundaries, both directions).

Embeddings are untied (`--untied`) so that the links carry the pipeline's traffic only. With
`--tied`, DeepSpeed also all-reduces the embedding's gradient between the first and the last stage every
step (8192 x 192 fp32 = 6.3 MB for the small GPT, twice the uncompressed activation traffic of a step),
which no pipeline compression touches: results/bench/e2e_tied.md shows that run. For SmolLM2 that all-reduce
is 49152 x 576 fp32 = 113 MB a step, 4x its uncompressed pipeline traffic at 4 stages.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

from pp_lab.paths import ROOT
from pp_lab.launch import JOB_MARK, kill_job, run_job
from pp_lab.bench.throttle import LINKS, parse_link

THROTTLE = ROOT / "benchmarks" / "throttle.py"
SPECS = ["none", "int8", "int4", "topk:0.1+ef", "act=int4,grad=int8"]
SUBNET = "198.18.0"
RECIPES = {"pretrain": "`{model}` GPT", "finetune": "SmolLM2-135M (recipes/finetune.py)"}
"""recipes/<name>.py -> what the result file calls its model."""


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


BURST_MIN = 8 * 1024
"""The token bucket's floor: a few full-size packets (tbf splits larger GSO packets to fit). Everything up to the
bucket's size crosses an idle link at once, so a bigger floor would hide the link from small messages (a decode
step's hidden states) and from the first part of every compressed one."""


BUCKET = f"a token bucket of 1 ms of traffic (at least {BURST_MIN // 1024} KiB)"
"""How the result files describe the bucket."""


def bucket_bytes(rate_mbit: float) -> int:
    """tbf's burst for a link of `rate_mbit`: 1 ms of traffic, at least BURST_MIN."""
    return max(BURST_MIN, int(rate_mbit * 1e6 / 8 / 1000))


class Namespaces:
    """n stage namespaces on one bridge; `shape(rate)` limits every veth end to `rate` Mbit/s (0: none)."""

    def __init__(self, n: int) -> None:
        self.n, self.tag = n, f"ppcb{uuid.uuid4().hex[:6]}"
        self.hub, self.stages = f"{self.tag}_hub", [f"{self.tag}_s{r}" for r in range(n)]

    def __enter__(self) -> "Namespaces":
        try:
            for ns in [self.hub, *self.stages]:
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for r, ns in enumerate(self.stages):
                sh("ip", "link", "add", f"v{r}", "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
                sh("ip", "-n", self.hub, "link", "set", f"v{r}", "master", "br0", "up")
                sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{r + 1}/24", "dev", "eth0")
                sh("ip", "-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.stages, self.hub]:  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def shape(self, rate_mbit: float) -> None:
        """tbf on both ends of every veth, its bucket sized by `bucket_bytes`."""
        burst = bucket_bytes(rate_mbit)
        for r, ns in enumerate(self.stages):
            for where, dev in ((ns, "eth0"), (self.hub, f"v{r}")):
                subprocess.run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if rate_mbit > 0:
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                       "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "200ms")

    def run(self, args: list[str], env: dict[str, str], timeout: int) -> tuple[int, str]:
        """Start rank r in namespace r (env:// rendezvous at rank 0's address); wait for all of them."""
        mark = uuid.uuid4().hex
        procs = []
        logs = [Path(f"/tmp/{self.tag}_{mark}_{r}.log") for r in range(self.n)]
        try:
            for r, ns in enumerate(self.stages):
                renv = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.n), "LOCAL_WORLD_SIZE": str(self.n),
                        "MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "eth0",
                        JOB_MARK: mark}
                with open(logs[r], "w") as log:
                    procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *args], env=renv, cwd=ROOT, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return 124, f"timed out after {timeout} s\n" + logs[0].read_text()[-3000:]
                if p.returncode != 0:  # one rank failed: the others would wait forever
                    break
            rc = next((p.returncode for p in procs if p.returncode), 0)
            return rc, "\n".join(f"--- rank {r}\n{p.read_text()[-3000:]}" for r, p in enumerate(logs))
        finally:
            kill_job(mark)
            for p in logs:
                p.unlink(missing_ok=True)


def shaped_links(stages: int, links: list[tuple[str, float, float]], netns: bool,
                 env: dict[str, str]) -> Iterator[tuple[Namespaces | None, tuple[str, float, float], dict[str, str]]]:
    """Each link in turn: (the stage namespaces shaped to its rate, or None when emulated; the link; the environment
    that makes benchmarks/throttle.py add its latency, and its rate too when emulated). Namespaces go on exit."""
    with Namespaces(stages) if netns else contextlib.nullcontext() as ns:
        for name, rate, latency in links:
            if ns:
                ns.shape(rate)
            per_boundary = {"PPC_BENCH_LINKS": name} if "=" in name else {}  # emulated per boundary, on top
            yield ns, (name, rate, latency), {**env, "PPC_BENCH_LATENCY_MS": str(latency),
                                               "PPC_BENCH_RATE_MBIT": "0" if ns else str(rate), **per_boundary}


def run_throttled(ns: Namespaces | None, stages: int, script: Path, args: list[str], env: dict[str, str],
                  timeout: int) -> tuple[int, str]:
    """`script` on `stages` processes through benchmarks/throttle.py: one per namespace, else on this host."""
    if ns:
        return ns.run([sys.executable, str(THROTTLE), str(script), *args], env, timeout)
    return run_job(THROTTLE, stages, str(script), *args, env=env, timeout=timeout)


def netns_permitted() -> str | None:
    """None when namespaces work here, else the reason they do not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip`/`tc` not found (Debian: iproute2)"
    if os.geteuid() != 0:
        return "not root"
    probe = f"ppcb_probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if r.returncode == 0 else f"ip netns add failed: {r.stderr.strip()}"


def measure(rows: list[dict], out: Path, skip: int = 2) -> dict:
    train = [r for r in rows if r["kind"] == "train"][skip:]
    if not train:
        raise SystemExit(f"{out}: fewer than {skip + 1} logged steps; raise --steps")
    step_s = sum(r["step_s"] for r in train) / len(train)
    return {"step_s": step_s, "tokens_per_s": train[0]["tokens_per_s"] * train[0]["step_s"] / step_s,
            "act_wire": train[-1]["act_wire_bytes"], "grad_wire": train[-1]["grad_wire_bytes"],
            "raw": train[-1]["act_raw_bytes"] + train[-1]["grad_raw_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", type=parse_link, action="append", default=None, help=f"default: {', '.join(LINKS)}")
    ap.add_argument("--spec", action="append", default=None,
                    help=f"--pp-compress values, optionally followed by this run's own recipe options, e.g. "
                         f"'int8 --subspace 12'; default: {SPECS}")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--recipe", default="pretrain", choices=list(RECIPES),
                    help="pretrain: the recipe GPT of --model; finetune: SmolLM2-135M (`make models`, or --checkpoint "
                         "after --), with the real model's compute per step")
    ap.add_argument("--model", default=None, help="pretrain's GPT preset (default: small)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run each link's specs this many times in turns; a row is the run of the median step time")
    ap.add_argument("--tied", action="store_true", help="tied embeddings (adds the embedding-gradient all-reduce to the links)")
    ap.add_argument("--emulate", action="store_true", help="in-process link emulation even where namespaces work")
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the mean step time (e.g. --skip 40: "
                    "after auto's first rounds and trials, with the default auto:every=20)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "e2e")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "e2e")
    ap.add_argument("recipe_args", nargs=argparse.REMAINDER, help="after --: more options of the recipe (e.g. --corpus fixture)")
    args = ap.parse_args()
    if not 0 <= args.skip < args.steps:
        raise SystemExit(f"--skip {args.skip}: accepted 0..{args.steps - 1} (the run has --steps {args.steps})")
    extra = args.recipe_args[1:] if args.recipe_args[:1] == ["--"] else args.recipe_args
    if args.recipe == "finetune" and args.model:
        raise SystemExit(f"--model {args.model}: the finetune recipe's model is its checkpoint (--checkpoint after --)")
    corpus_flag, corpus_default = ("--corpus", "shakespeare") if args.recipe == "pretrain" else ("--data", "austen")
    corpus = extra[extra.index(corpus_flag) + 1] if corpus_flag in extra else corpus_default
    links = args.link or [parse_link(k) for k in LINKS]
    specs = args.spec or SPECS
    why_not = "--emulate given" if args.emulate else netns_permitted()
    mode = "netns+tbf" if why_not is None else "emulated"
    if why_not:
        print(f"WARNING: network namespaces not used ({why_not}): links are EMULATED in-process "
              "(the sender sleeps latency + bytes/rate per message); results are labelled 'emulated'", flush=True)
    subprocess.run([sys.executable, str(ROOT / "recipes" / "data.py"), "fetch", corpus], check=True)  # no net in a netns
    model = ["--model", args.model or "small"] if args.recipe == "pretrain" else []
    recipe = [*extra, "--stages", str(args.stages), *model, "--steps", str(args.steps), "--log-every", "1",
              "--eval-every", "0", "--eval-batches", "1", "--overwrite", *([] if args.tied else ["--untied"])]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    results: list[dict] = []
    timelines: dict[tuple[str, str], tuple[list[tuple[int, float]], list[str]]] = {}
    for ns, (name, rate, latency), lenv in shaped_links(args.stages, links, mode == "netns+tbf", env):
        runs: dict[str, list[tuple[dict, list[dict], str]]] = {spec: [] for spec in specs}
        for turn in range(args.rounds):  # the specs in turns, so that a drift of the machine spreads over all of them
            for spec in specs:
                out = args.work / (f"{name}_{re.sub(r'[^A-Za-z0-9.]+', '-', spec)}"
                                   + (f"_r{turn + 1}" if args.rounds > 1 else ""))
                compress, *own = spec.split()  # 'int8 --subspace 12': a spec, then options of this run only
                rargs = [*recipe, *own, "--pp-compress", compress, "--out", str(out)]
                t0 = time.perf_counter()
                rc, log = run_throttled(ns, args.stages, ROOT / "recipes" / f"{args.recipe}.py", rargs, lenv, 3600)
                if rc != 0:
                    raise SystemExit(f"link {name}, spec {spec}: exit {rc}\n{log[-4000:]}")
                (out / "job.log").write_text(log)  # every run's log (the table keeps only the median run's decisions)
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                a = json.loads((out / "run.json").read_text())["args"]
                r = {"mode": mode, "link": name, "rate_mbit": rate, "latency_ms": latency, "spec": spec,
                     **measure(rows, out, args.skip), "batch": f"micro-batch {a['micro_batch']} x seq {a['seq_len']}, "
                                                    f"{a['grad_accum']} micro-batches per step"}
                runs[spec].append((r, rows, log))
                print(f"{name:>8s} {spec:24s} step {r['step_s']:.3f} s  {r['tokens_per_s']:7.0f} tok/s  wire "
                      f"{(r['act_wire'] + r['grad_wire']) / 1e6:6.2f} MB/step"
                      + (f"  (round {turn + 1})" if args.rounds > 1 else "") + f"  ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
        for spec in specs:
            r, rows, log = median_run(runs[spec])
            base = next((b for b in results if b["link"] == name and b["spec"] == "none"), None)
            r["speedup"] = base["step_s"] / r["step_s"] if base else None
            results.append(r)
            if "~" in name:  # a link that changes during the run: each step's time, and auto's decisions
                timelines[name, spec] = ([(x["step"], x["step_s"]) for x in rows if x["kind"] == "train"],
                                         AUTO_LINE.findall(log))
            elif AUTO_LINE.search(log):  # auto on a steady link: its decisions, which say why its step took what it did
                timelines[name, spec] = ([], AUTO_LINE.findall(log))
    write(results, args, mode, timelines)


def median_run(runs: list[tuple[dict, list[dict], str]]) -> tuple[dict, list[dict], str]:
    """Of one spec's rounds on one link, the run of the median step time (the lower one of an even count), its row
    carrying every round's step time."""
    ordered = sorted(runs, key=lambda run: run[0]["step_s"])
    r, rows, log = ordered[(len(ordered) - 1) // 2]
    return {**r, "rounds": " ".join(f"{run[0]['step_s']:.3f}" for run in runs)}, rows, log


AUTO_LINE = re.compile(r"step \d+: pp_compress auto: boundary \d+ \w+: [^\n]*")
"""auto's log line of a decision at a step (pp_compress.decide.decide_round)."""


def timeline(timelines: dict[tuple[str, str], tuple[list[tuple[int, float]], list[str]]]) -> list[str]:
    """Markdown: per link that changes during the run, each step's time per spec side by side; then, on every link,
    auto's decisions with their steps."""
    lines = []
    for link in dict.fromkeys(name for name, _ in timelines):
        specs = [spec for name, spec in timelines if name == link]
        steps = sorted({s for spec in specs for s, _ in timelines[link, spec][0]})
        if steps:
            lines += ["", f"Step times (s) on `{link}`, whose link changes during the run:", "",
                      "| step | " + " | ".join(f"`{spec}`" for spec in specs) + " |", "|---|" + "---|" * len(specs)]
        for step in steps:
            cells = [next((f"{t:.3f}" for s, t in timelines[link, spec][0] if s == step), "") for spec in specs]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
        for spec in specs:
            if timelines[link, spec][1]:
                lines += ["", f"`{spec}`'s decisions on `{link}` (the sender's log, deduplicated across processes):", ""]
                lines += [f"- {d}" for d in dict.fromkeys(timelines[link, spec][1])]
    return lines


def write(results: list[dict], args: argparse.Namespace, mode: str,
          timelines: dict[tuple[str, str], tuple[list[tuple[int, float]], list[str]]] | None = None) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, list(results[0]))
        w.writeheader()
        w.writerows(results)
    how = (f"kernel tbf rate limits on veth pairs between per-stage network namespaces, {BUCKET}; latency added per "
           "message by the sender (no netem in this kernel)") if mode == "netns+tbf" else \
        "EMULATED in-process: the sender sleeps latency + bytes/rate before each message"
    command = shlex.join(["python", "benchmarks/e2e.py", *sys.argv[1:]])
    model = RECIPES[args.recipe].format(model=args.model or "small")
    lines = [f"Command: `{command}`", "", f"{model}, {args.stages} stages, {results[0]['batch']}, fp32, "
             f"CPU/gloo, {args.steps} steps per run (mean of steps {args.skip + 1}..{args.steps}); links: {how}."
             + (" Tied embeddings: the links also carry the embedding-gradient all-reduce between the first and last "
                "stage each step (not counted in wire MB)." if args.tied else " Untied embeddings: the links carry pipeline "
                "traffic only.") + (f" Recipe options: `{' '.join(args.recipe_args)}`." if args.recipe_args else ""), "",
             "| link | latency | pp_compress | wire MB/step | step time (s) | tokens/s | speedup vs none |"
             + (" each round's step time (s) |" if args.rounds > 1 else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if args.rounds > 1 else "")]
    if args.rounds > 1:
        lines[2] += (f" Each link's specs ran {args.rounds} times in turns; a row is the round of the median step "
                     "time.")
    for r in results:
        per_boundary = "=" in r["link"]  # a link per boundary: the profile's own text says what each is
        link = r["link"] if per_boundary else "unlimited" if r["rate_mbit"] == 0 else f"{r['link']}"
        latency = "per link" if per_boundary else f"{r['latency_ms']:g} ms"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else ""
        lines.append(f"| `{link}` | {latency} | `{r['spec']}` | {(r['act_wire'] + r['grad_wire']) / 1e6:.2f} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {sp} |" + (f" {r['rounds']} |" if args.rounds > 1 else ""))
    lines += timeline(timelines or {})
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, args.out.with_suffix(".png"))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in results))
    specs = list(dict.fromkeys(r["spec"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(specs)
    for i, spec in enumerate(specs):
        ys = [next((r["tokens_per_s"] for r in results if r["link"] == ln and r["spec"] == spec), 0) for ln in links]
        ax.bar([j + i * width for j in range(len(links))], ys, width, label=spec)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(links))],
                  ["unlimited" if ln == "none" else ln.replace(",", "\n") for ln in links])
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title("Pipelined pretraining over rate-limited links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
