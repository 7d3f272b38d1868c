"""Checks that run on the device and are read later: a kernel's own flag (`Flag`) and the verdicts an engine reads
once per step (`Deferred`), so that the per-message path never waits for the device."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor


class Flag(NamedTuple):
    """A kernel's own check: an int32 slot on the device that stays 0 when fine, and the error to raise if it is not."""

    buf: Tensor
    """int32 values on the device; the kernel sets buf[index] to non-zero where its check fails."""
    index: int
    error: type[Exception]
    message: Callable[[], str]


class Deferred:
    """Checks whose verdicts stay on the device until `raise_pending()` or `poll()`. On an accelerator a `bool()` of
    a device tensor waits for every queued kernel, so the host could not queue the next micro-batch meanwhile;
    deferred, the per-message path never waits. An engine reads all verdicts of a step at once, at its end
    (`raise_pending`); a loop that must never wait polls (`poll`): the verdicts travel to pinned host memory
    asynchronously and are read once they have arrived, a step or so later. The errors are the same and still name
    the boundary and the step; they are raised there rather than inside the message.

    Two kinds of verdict: a bool tensor (`expect`), and a slot of a zeroed int32 buffer per device that a kernel sets
    (`flag`). The slots are read and zeroed together when the verdicts are sent: no allocation and no fill per check.
    The kernels that set them run on the stream that sends them (the current one), as every check's kernels do."""

    SLOTS = 4096
    """Slots per buffer; a new buffer is taken when one fills up before the verdicts are sent."""

    def __init__(self) -> None:
        self._flags: list[Tensor] = []  # bool verdicts, True when fine
        self._errors: list[tuple[type[Exception], Callable[[], str]]] = []
        self._free: dict[torch.device, tuple[Tensor, int]] = {}  # per device: its buffer and the next free slot
        self._full: list[tuple[Tensor, int]] = []  # buffers filled up since the last send, with their used slots
        self._slot_errors: list[tuple[type[Exception], Callable[[], str]]] = []  # in slot order, buffer by buffer
        self._inflight: list[tuple[Tensor, Any, list[tuple[type[Exception], Callable[[], str]]]]] = []
        self._spare: list[Tensor] = []  # pinned host buffers whose verdicts were read

    def expect(self, ok: Tensor, error: type[Exception], message: Callable[[], str]) -> None:
        """Record a verdict (a one-element bool tensor, True when fine) and the error to raise if it is False.
        `message` must not hold large tensors: it lives until the verdict is read."""
        self._flags.append(ok.reshape(()))
        self._errors.append((error, message))

    def flag(self, device: torch.device, error: type[Exception], message: Callable[[], str]) -> Flag:
        """A zeroed slot on `device` for a kernel to set where its check fails, and the error to raise then."""
        buf, used = self._free.get(device) or (torch.zeros(self.SLOTS, dtype=torch.int32, device=device), 0)
        if used == self.SLOTS:
            self._full.append((buf, used))
            buf, used = torch.zeros(self.SLOTS, dtype=torch.int32, device=device), 0
        self._free[device] = (buf, used + 1)
        self._slot_errors.append((error, message))
        return Flag(buf, used, error, message)

    def __len__(self) -> int:
        return len(self._flags) + len(self._slot_errors) + sum(len(errors) for _, _, errors in self._inflight)

    def raise_pending(self) -> None:
        """Read every recorded verdict (one host synchronization for all of them) and raise the first that failed."""
        self._send()
        inflight, self._inflight = self._inflight, []
        for host, event, errors in inflight:
            if event is not None:
                event.synchronize()
            self._read(host, event, errors)

    def poll(self) -> None:
        """Start copying the recorded verdicts to the host, and raise the first failed one among those whose copy has
        arrived; never waits for the device."""
        self._send()
        while self._inflight and (self._inflight[0][1] is None or self._inflight[0][1].query()):
            host, event, errors = self._inflight.pop(0)
            self._read(host, event, errors)

    def _send(self) -> None:
        used = self._full + [(buf, n) for buf, n in self._free.values() if n]
        # (n,) int32 on the device of the checks, non-zero where a check failed: the slots as they are
        parts = ([(~torch.stack(self._flags)).int()] if self._flags else []) + [buf[:n] for buf, n in used]
        if not parts:
            return
        failed, errors = parts[0] if len(parts) == 1 else torch.cat(parts), self._errors + self._slot_errors
        self._flags, self._errors, self._full, self._slot_errors = [], [], [], []
        if failed.device.type == "cpu":
            failed = failed.clone()  # the slots are zeroed below
            self._inflight.append((failed, None, errors))
        else:
            host = self._host(failed.numel())
            host.copy_(failed, non_blocking=True)
            event = torch.Event(device=failed.device)
            event.record()
            self._inflight.append((host, event, errors))
        for buf, n in used:  # after the copy, in stream order: the slots are free again
            buf[:n].zero_()
        self._free = {device: (buf, 0) for device, (buf, _) in self._free.items()}

    def _host(self, n: int) -> Tensor:
        """(n,) int32 pinned host memory for a copy of verdicts: a buffer already read if one is large enough."""
        for i, buf in enumerate(self._spare):
            if buf.numel() >= n:
                return self._spare.pop(i)[:n]
        return torch.empty(max(n, self.SLOTS), dtype=torch.int32, pin_memory=True)[:n]

    def _read(self, host: Tensor, event: Any, errors: list[tuple[type[Exception], Callable[[], str]]]) -> None:
        """Raise the first failed verdict of a copy that has arrived; its pinned buffer (a copy from an accelerator,
        `event` not None) is free for the next copy."""
        bad = host.nonzero().flatten().tolist()  # a host tensor: no device synchronization
        if event is not None:
            self._spare.append(host._base if host._base is not None else host)
        if bad:
            error, message = errors[bad[0]]
            raise error(message())
