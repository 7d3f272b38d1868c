"""Run a recipe with DeepSpeed's pipeline p2p sends delayed in the sending process (benchmarks only).

    PPC_BENCH_LATENCY_MS=1 PPC_BENCH_RATE_MBIT=100 torchrun --nproc_per_node 2 benchmarks/throttle.py recipes/pretrain.py ...

Before each `deepspeed.runtime.pipe.p2p.send` (every pipeline message: DeepSpeed's meta handshake and
pp_compress's payloads alike) the sender sleeps latency + bytes * 8 / rate. With PPC_BENCH_P2P=torch (scripts that
talk torch.distributed directly, like KV-cached generation), `torch.distributed.send` is delayed the same way, and a
`torch.distributed.broadcast` by its source rank (a new token going back to every stage) is one message too. benchmarks/e2e.py uses it
for two things, and labels both in its results:
- a link's one-way latency, on top of real kernel rate limits (tc tbf): this kernel has no netem;
- the whole link (latency and bandwidth), only where network namespaces are not permitted.
A sleeping sender models a store-and-forward link that blocks the sender; DeepSpeed's p2p sends are
blocking anyway, so the stage waits either way. Never used in training.
"""
from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any


def delay_s(nbytes: int, latency_ms: float, rate_mbit: float) -> float:
    """Seconds one message of `nbytes` spends on a link of this latency and rate (rate 0 = unlimited)."""
    return latency_ms / 1e3 + (nbytes * 8 / (rate_mbit * 1e6) if rate_mbit > 0 else 0.0)


def install(latency_ms: float, rate_mbit: float, p2p_api: str = "deepspeed") -> None:
    """Wrap p2p.send; pp_compress's engine and DeepSpeed's own look it up on the module at call time. p2p_api "torch":
    wrap torch.distributed.send and broadcast instead (DeepSpeed's send calls torch's: never both)."""
    if p2p_api == "torch":
        import torch.distributed as dist

        tsend, tbroadcast = dist.send, dist.broadcast

        def delayed_send(tensor: Any, dst: int, *a: Any, **kw: Any) -> Any:
            time.sleep(delay_s(tensor.numel() * tensor.element_size(), latency_ms, rate_mbit))
            return tsend(tensor, dst, *a, **kw)

        def delayed_broadcast(tensor: Any, src: int, *a: Any, **kw: Any) -> Any:
            if dist.get_rank() == src:
                time.sleep(delay_s(tensor.numel() * tensor.element_size(), latency_ms, rate_mbit))
            return tbroadcast(tensor, src, *a, **kw)

        dist.send, dist.broadcast = delayed_send, delayed_broadcast
        return
    if p2p_api != "deepspeed":
        raise SystemExit(f"PPC_BENCH_P2P={p2p_api!r}; accepted: deepspeed, torch")
    from deepspeed.runtime.pipe import p2p

    send = p2p.send

    def throttled_send(tensor: Any, dest_stage: int, async_op: bool = False) -> Any:
        time.sleep(delay_s(tensor.numel() * tensor.element_size(), latency_ms, rate_mbit))
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
    install(latency, rate, os.environ.get("PPC_BENCH_P2P", "deepspeed"))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
