"""The start-up self-check: before the first step, one uncompressed (`identity`) message each way across every
boundary through the engine's own p2p path, compared bitwise with what was sent.

The adapters depend on engine internals that move between releases (which instruction sends what, which buffers a
receive reuses). A transport that changed under them could otherwise train on: wrongly, or slowly. The probe's
values are ones a changed transport would alter: signed zeros, a subnormal, the dtype's extremes and distinct
random values, in a shape no model tensor has by accident.

Each adapter supplies `exchange(ops)`, which runs a list of ("send" | "recv", peer stage, buffer) through its p2p:
in order, one blocking call at a time (DeepSpeed's p2p.send/recv), or all posted at once (torch.distributed's batched
isend/irecv). The order given (receive from the previous stage, send to the next, then the same backwards) lets a
chain of blocking calls finish without deadlock.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .config import parse_spec
from .ops.base import TensorSpec
from .pipe import StageCompression
from .policy import Where

Op = tuple[str, int, Tensor]
PROBE_SHAPE = (3, 7, 64)


def probe(boundary: int, direction: str, device: torch.device) -> Tensor:
    """The message across `boundary` in `direction`: fp32 (3, 7, 64), the same on every rank."""
    g = torch.Generator().manual_seed(7919 * (boundary + 1) + (direction == "grad"))
    x = torch.randn(PROBE_SHAPE, generator=g)  # (3, 7, 64)
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, 1e-40, -3.4e38, 3.4e38, float(boundary)])
    return x.to(device)


def self_check(stage: int, stages: int, device: torch.device, exchange: Callable[[list[Op]], None],
               engine: str) -> None:
    """Run the check for `stage` of `stages` (every stage must call it); RuntimeError naming the boundary and
    direction whose message arrived changed."""
    link = StageCompression(parse_spec("identity"), stage, stages)
    spec = [TensorSpec(PROBE_SHAPE, torch.float32)]
    ops: list[Op] = []
    received: list[tuple[int, str, Where, list[tuple[int, Tensor]]]] = []
    # (peer, boundary, direction) in the chain-safe order: from the previous stage and to the next, then backwards
    chain = ((stage - 1, stage - 1, "act", True), (stage + 1, stage, "act", False),
             (stage + 1, stage, "grad", True), (stage - 1, stage - 1, "grad", False))
    for peer, boundary, direction, incoming in chain:
        if not 0 <= peer < stages:
            continue
        where = Where(boundary, direction, 0, 0, True)
        if incoming:
            bufs = link.recv_buffers(spec, where, device, [None])
            ops += [("recv", peer, buf) for _, buf in bufs]
            received.append((peer, direction, where, bufs))
        else:
            ops += [("send", peer, buf) for _, buf in link.encode([probe(boundary, direction, device)], where)]
    exchange(ops)
    for peer, direction, where, bufs in received:
        got = link.decode(spec, where, [None], bufs)[0]
        want = probe(where.boundary, direction, device)
        same = got.view(torch.int32) == want.view(torch.int32)  # bitwise: -0.0 and NaN payloads count
        if not bool(same.all()):
            raise RuntimeError(
                f"pp_compress start-up self-check: an uncompressed message from stage {peer} to stage {stage} "
                f"(boundary {where.boundary}, {direction}) arrived changed through {engine}'s p2p: "
                f"{int((~same).sum())} of {same.numel()} values differ. The engine's transport is not what this "
                "adapter was written for; compressed messages would decode wrongly. Use a tested engine version "
                "(see the adapter's TESTED) or report this with the engine's version")
