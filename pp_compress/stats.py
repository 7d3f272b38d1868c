"""Counters per boundary and direction: bytes before/after, ratio, timings, relative error."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class DirectionStats:
    """Accumulated over every tensor one boundary sent in one direction."""

    calls: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    compress_s: float = 0.0
    """Seconds spent compressing the timed messages (`compress_timed` of them): every message on CPU; on an accelerator
    those whose relative error is measured, since a pair of events per span costs the host more than a small message's
    kernels."""
    decompress_s: float = 0.0
    """Seconds spent decompressing the timed messages (`decompress_timed` of them), as compress_s."""
    compress_timed: int = 0
    decompress_timed: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    saturated: int = 0
    """Elements an error-feedback wrapper clipped to the input dtype's range (its state keeps the rest)."""
    compressed: int = 0
    """Float tensors that went through the operator."""
    skipped: int = 0
    """Messages the configured (non-identity) operator left uncompressed for a reason the user can change: every
    float tensor below min_numel, or no float tensor at all. Warm-up steps are intended and not counted."""
    skip_reason: str = ""
    """Why the last skipped message was skipped, e.g. "below min_numel"."""
    pending: Tensor | None = None
    """Squared error and norm (2,) fp64 of measurements on an accelerator, summed on the device (folded in when
    read)."""
    pending_times: list[tuple[str, Any, Any]] = field(default_factory=list)
    """Codec spans on an accelerator: (which, start event, end event), folded in once their end has passed."""

    def start(self, device: torch.device, sampled: bool = True) -> Any:
        """The start of a codec span: the wall clock on CPU; on an accelerator an event on its stream (the host's
        clock would time only the launches of asynchronous work), or None unless `sampled` (the span is not timed)."""
        if device.type == "cpu":
            return time.perf_counter()
        if not sampled:
            return None
        event = torch.Event(device=device, enable_timing=True)
        event.record()
        return event

    def stop(self, span: Any, which: str) -> None:
        """End a span started by `start` and add its time to compress_s or decompress_s (`which`): at once on CPU, on
        an accelerator once the device has passed the end (never waiting for it here)."""
        if span is None:
            return
        setattr(self, f"{which}_timed", getattr(self, f"{which}_timed") + 1)
        if isinstance(span, float):
            setattr(self, f"{which}_s", getattr(self, f"{which}_s") + time.perf_counter() - span)
            return
        end = torch.Event(device=span.device, enable_timing=True)
        end.record()
        self.pending_times.append((which, span, end))
        self.fold_times(wait=False)

    def fold_times(self, wait: bool = True) -> None:
        """Add the accelerator spans whose end has passed (all of them with `wait`, the one host wait for them)."""
        while self.pending_times and (wait or self.pending_times[0][2].query()):
            which, begin, end = self.pending_times.pop(0)
            end.synchronize()
            setattr(self, f"{which}_s", getattr(self, f"{which}_s") + begin.elapsed_time(end) / 1e3)

    @property
    def noop(self) -> bool:
        """Messages were sent under a compressing spec and none was compressed: the setting did nothing here."""
        return self.skipped > 0 and self.compressed == 0

    @property
    def ratio(self) -> float:
        """raw bytes / wire bytes (1.0 before anything was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    @property
    def rel_error(self) -> float:
        """||x - x_hat|| / ||x|| over everything measured (NaN when nothing was measured)."""
        self.fold()
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq else float("nan")

    def fold(self) -> None:
        """Add the measurements still on the device (one host read for all of them)."""
        if self.pending is not None:
            sums, self.pending = self.pending.tolist(), None
            self.err_sq, self.ref_sq = self.err_sq + sums[0], self.ref_sq + sums[1]

    def record(self, raw_bytes: int, wire_bytes: int, compress_s: float = 0.0, decompress_s: float = 0.0) -> None:
        self.calls += 1
        self.raw_bytes += raw_bytes
        self.wire_bytes += wire_bytes
        self.compress_s += compress_s
        self.decompress_s += decompress_s

    def record_error(self, x: Tensor, x_hat: Tensor) -> None:
        """Add ||x - x_hat||^2 and ||x||^2 (in float64 on CPU). On an accelerator they are summed there until read,
        so measuring never waits for the device; with Triton in one kernel (torch's ops take seven full-size passes)."""
        from .ops import triton_int

        if x.device.type == "cpu":
            ref = x.detach().double()
            self.err_sq += float(torch.sum((ref - x_hat.detach().double()) ** 2))
            self.ref_sq += float(torch.sum(ref**2))
            return
        if self.pending is None:
            self.pending = torch.zeros(2, dtype=torch.float64, device=x.device)
        if triton_int.sums(x, x_hat):
            triton_int.error_sums(x.detach(), x_hat.detach(), self.pending)
        else:
            ref = x.detach().float()
            self.pending += torch.stack((torch.sum((ref - x_hat.detach().float()) ** 2), torch.sum(ref**2))).double()

    def as_dict(self) -> dict[str, Any]:
        self.fold()
        self.fold_times()
        return {
            "calls": self.calls,
            "raw_bytes": self.raw_bytes,
            "wire_bytes": self.wire_bytes,
            "ratio": round(self.ratio, 4),
            "rel_error": round(self.rel_error, 6),
            "compress_s": round(self.compress_s, 6),
            "decompress_s": round(self.decompress_s, 6),
            "compress_timed": self.compress_timed,
            "decompress_timed": self.decompress_timed,
            "saturated": self.saturated,
            "compressed": self.compressed,
            "skipped": self.skipped,
            "note": f"skipped ({self.skip_reason})" if self.noop else "",
            "err_sq": self.err_sq,
            "ref_sq": self.ref_sq,
        }


def format_table(rows: dict[str, DirectionStats] | dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of named stats, e.g. {"b0.act": ..., "b0.grad": ...} (DirectionStats or their as_dict())."""
    head = f"{'where':<12} {'calls':>6} {'raw MB':>9} {'wire MB':>9} {'ratio':>7} {'rel err':>8}"
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        s = _Row(row) if isinstance(row, dict) else row
        sizes = f"{name:<12} {s.calls:>6} {s.raw_bytes / 1e6:>9.2f} {s.wire_bytes / 1e6:>9.2f}"
        note = s.note if isinstance(row, dict) else (f"skipped ({s.skip_reason})" if s.noop else "")
        lines.append(f"{sizes}  {note}" if note else f"{sizes} {s.ratio:>7.2f} {s.rel_error:>8.4f}")
    return "\n".join(lines)


class _Row:
    """Attribute access to an as_dict() row, for format_table."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.note = ""  # rows written before the note existed
        self.__dict__.update(row)


def merge_rows(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One row per boundary and direction from every rank's stats (`DirectionStats.as_dict` per key): sums over ranks
    (with tensor parallelism each TP rank sends its own slice, so the sum is the boundary's traffic)."""
    out: dict[str, dict[str, Any]] = {}
    for rows in per_rank:
        for key, r in rows.items():
            if key not in out:
                out[key] = dict(r)
                continue
            m = out[key]
            for f in ("calls", "raw_bytes", "wire_bytes", "compress_s", "decompress_s", "compress_timed",
                      "decompress_timed", "err_sq", "ref_sq", "saturated", "compressed", "skipped"):
                m[f] += r[f]
            m["note"] = (m["note"] or r["note"]) if not m["compressed"] else ""
            m["ratio"] = round(m["raw_bytes"] / m["wire_bytes"], 4) if m["wire_bytes"] else 1.0
            m["rel_error"] = round((m["err_sq"] / m["ref_sq"]) ** 0.5, 6) if m["ref_sq"] else float("nan")
    return out
