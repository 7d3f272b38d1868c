"""Run a recipe with DeepSpeed's pipeline p2p sends delayed in the sending process (benchmarks only).

    PPC_BENCH_LATENCY_MS=1 PPC_BENCH_RATE_MBIT=100 torchrun --nproc_per_node 2 benchmarks/throttle.py recipes/pretrain.py ...

Before each `deepspeed.runtime.pipe.p2p.send` (every pipeline message: DeepSpeed's meta handshake and
pp_compress's payloads alike) the sender sleeps latency + bytes * 8 / rate. With PPC_BENCH_P2P=torch (scripts that
talk torch.distributed directly, like KV-cached generation), `torch.distributed.send` is delayed the same way, and a
`torch.distributed.broadcast` by its source rank (a new token going back to every stage) is one message too. With
PPC_BENCH_P2P=batch (Megatron-Core's schedules and pp_compress.megatron post P2P ops in batches), before
`torch.distributed.batch_isend_irecv` the sender sleeps for each of the batch's sends in turn. benchmarks/e2e.py uses it
for two things, and labels both in its results:
- a link's one-way latency, on top of real kernel rate limits (tc tbf): this kernel has no netem;
- the whole link (latency and bandwidth), only where network namespaces are not permitted.
A sleeping sender models a store-and-forward link that blocks the sender; DeepSpeed's p2p sends are
blocking anyway, so the stage waits either way. Never used in training.

PPC_BENCH_LINKS gives each boundary its own link, and a link may change during the run (emulated only), e.g.
`0=none,1=5mbit@20ms~60s=100mbit@1ms`: boundary 0 unlimited, boundary 1 at 5 Mbit/s with 20 ms until 60 s after
the first message, then 100 Mbit/s with 1 ms. Boundaries it does not name take PPC_BENCH_LATENCY_MS / _RATE_MBIT.
A message's boundary is the lower of its two stages.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import time
from typing import Any

LINKS = {"none": (0.0, 0.0), "10gbit": (10_000.0, 0.05), "1gbit": (1_000.0, 0.1), "100mbit": (100.0, 1.0),
         "25mbit": (25.0, 10.0)}
"""name -> (rate Mbit/s, one-way latency ms); 0 = unlimited. Latencies: datacenter, LAN, WAN, internet."""


def parse_link(text: str) -> tuple[str, float, float]:
    """'100mbit' or '100mbit@2ms' (or 'none') -> (name, Mbit/s, one-way latency ms). A link per boundary,
    '0=none,1=5mbit@20ms' (see benchmarks/throttle.py: PPC_BENCH_LINKS), is one profile: (its text, 0, 0), emulated."""
    if "=" in text:
        try:
            parse_links(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text, 0.0, 0.0
    m = re.fullmatch(r"(none|(\d+(?:\.\d+)?)(mbit|gbit))(?:@(\d+(?:\.\d+)?)ms)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"link {text!r}; accepted: none, <N>mbit, <N>gbit, optionally @<L>ms "
                                         f"(e.g. 100mbit@2ms); defaults: {', '.join(LINKS)}")
    name = m.group(1)
    rate = 0.0 if name == "none" else float(m.group(2)) * (1000 if m.group(3) == "gbit" else 1)
    latency = float(m.group(4)) if m.group(4) else LINKS.get(name, (0.0, 0.0))[1]
    return name, rate, latency


def delay_s(nbytes: int, latency_ms: float, rate_mbit: float) -> float:
    """Seconds one message of `nbytes` spends on a link of this latency and rate (rate 0 = unlimited)."""
    return latency_ms / 1e3 + (nbytes * 8 / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0)


Schedule = list[tuple[float, float, float]]
"""A boundary's link over time: (from second, rate Mbit/s, one-way latency ms), in time order, the first from 0."""


def parse_links(text: str) -> dict[int, Schedule]:
    """'0=none,1=5mbit@20ms~60s=100mbit@1ms' -> {0: [(0, 0, 0)], 1: [(0, 5, 20), (60, 100, 1)]}; errors name the part."""
    out: dict[int, Schedule] = {}
    for part in filter(None, text.split(",")):
        b, sep, rest = part.partition("=")
        if not sep or not b.isdigit() or int(b) in out:
            raise ValueError(f"PPC_BENCH_LINKS part {part!r}; accepted: <boundary>=<link>[~<S>s=<link>...], each "
                             "boundary once, e.g. 0=none,1=5mbit@20ms~60s=100mbit")
        first, *changes = rest.split("~")
        schedule = [(0.0, *parse_link(first)[1:])]
        for change in changes:
            when, sep, link = change.partition("=")
            if not sep or not when.endswith("s") or not when[:-1].replace(".", "", 1).isdigit() \
                    or float(when[:-1]) <= schedule[-1][0]:
                raise ValueError(f"PPC_BENCH_LINKS change {change!r} in {part!r}; accepted: ~<S>s=<link>, at "
                                 "increasing seconds")
            schedule.append((float(when[:-1]), *parse_link(link)[1:]))
        out[int(b)] = schedule
    return out


def link_at(schedule: Schedule, seconds: float) -> tuple[float, float]:
    """(rate Mbit/s, latency ms) of a schedule `seconds` after the first message."""
    rate, latency = schedule[0][1:]
    for start, r, lat in schedule:
        if seconds >= start:
            rate, latency = r, lat
    return rate, latency


def install(latency_ms: float, rate_mbit: float, p2p_api: str = "deepspeed",
            links: dict[int, Schedule] | None = None) -> None:
    """Wrap p2p.send; pp_compress's engine and DeepSpeed's own look it up on the module at call time. p2p_api "torch":
    wrap torch.distributed.send and broadcast instead (DeepSpeed's send calls torch's: never both); "batch":
    torch.distributed.batch_isend_irecv. `links`: a
    schedule per boundary (parse_links); the others take latency_ms and rate_mbit."""
    start: list[float] = []

    def delay(nbytes: int, src: int, dst: int) -> float:
        schedule = (links or {}).get(min(src, dst))
        if schedule is None:
            return delay_s(nbytes, latency_ms, rate_mbit)
        if not start:
            start.append(time.monotonic())
        return delay_s(nbytes, *reversed(link_at(schedule, time.monotonic() - start[0])))

    if p2p_api == "batch":
        import torch.distributed as dist

        tbatch = dist.batch_isend_irecv

        def delayed_batch(ops: list[Any]) -> Any:
            for op in ops:
                if op.op in (dist.isend, dist.send):
                    time.sleep(delay(op.tensor.numel() * op.tensor.element_size(), dist.get_rank(), op.peer))
            return tbatch(ops)

        dist.batch_isend_irecv = delayed_batch
        return
    if p2p_api == "torch":
        import torch.distributed as dist

        tsend, tbroadcast = dist.send, dist.broadcast

        def delayed_send(tensor: Any, dst: int, *a: Any, **kw: Any) -> Any:
            time.sleep(delay(tensor.numel() * tensor.element_size(), dist.get_rank(), dst))
            return tsend(tensor, dst, *a, **kw)

        def delayed_broadcast(tensor: Any, src: int, *a: Any, **kw: Any) -> Any:
            if dist.get_rank() == src:
                time.sleep(delay(tensor.numel() * tensor.element_size(), src, src + 1))
            return tbroadcast(tensor, src, *a, **kw)

        dist.send, dist.broadcast = delayed_send, delayed_broadcast
        return
    if p2p_api != "deepspeed":
        raise SystemExit(f"PPC_BENCH_P2P={p2p_api!r}; accepted: deepspeed, torch, batch")
    from deepspeed.runtime.pipe import p2p

    send = p2p.send

    def throttled_send(tensor: Any, dest_stage: int, async_op: bool = False) -> Any:
        time.sleep(delay(tensor.numel() * tensor.element_size(), p2p._grid.get_stage_id(), dest_stage))
        return send(tensor, dest_stage, async_op)

    p2p.send = throttled_send


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [ARGS...] (with PPC_BENCH_LATENCY_MS / PPC_BENCH_RATE_MBIT set)")
    latency = float(os.environ.get("PPC_BENCH_LATENCY_MS", "0"))
    rate = float(os.environ.get("PPC_BENCH_RATE_MBIT", "0"))
    if latency < 0 or rate < 0:
        raise SystemExit(f"PPC_BENCH_LATENCY_MS={latency}, PPC_BENCH_RATE_MBIT={rate}: both must be >= 0")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    links = parse_links(os.environ.get("PPC_BENCH_LINKS", ""))
    install(latency, rate, os.environ.get("PPC_BENCH_P2P", "deepspeed"), links)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
