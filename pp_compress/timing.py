"""How long work takes on its device: events on the device's stream on an accelerator (the host's clock would time
only the launches of asynchronous work), the wall clock on CPU. For measurements (auto's probes, the benchmarks);
the per-message statistics use DirectionStats.start / stop, which never wait."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def elapsed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds fn() takes, from an idle device to the end of its work (waits for both)."""
    if device.type == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    getattr(torch, device.type).synchronize(device)  # what was queued before does not count
    start, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median_time(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 1) -> float:
    """The median of `reps` elapsed() after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed(fn, device) for _ in range(reps))
