"""In-process boundary: compress activations on the way forward and gradients on the way back.

For simulation, single-device research and inference-time compression of Hugging Face models:
`compressed_boundary(x, act, grad, ...)` is the function form, `CompressionBoundary` the module form
(with warm-up, minimum size, eval spec, statistics and state in `state_dict`), and
`insert_boundaries(model, after=[2, 5, 8], cfg=...)` puts boundaries after transformer blocks.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .config import CompressionConfig, parse_spec
from .ops.base import Compressor, Context, TensorSpec
from .ops.deferred import Deferred
from .policy import BoundaryPolicy, Where
from .stats import DirectionStats


def _roundtrip(op: Compressor | None, x: Tensor, ctx: Context, stats: DirectionStats | None,
               measure: bool = False) -> Tensor:
    if op is None:
        if stats is not None:
            stats.record(x.numel() * x.element_size(), x.numel() * x.element_size())
        return x
    span = stats.start(x.device, measure) if stats is not None else None  # on an accelerator, timed with the error
    payload = op.compress(x, ctx)
    if stats is not None:
        stats.stop(span, "compress")
        span = stats.start(x.device, measure)
    y = op.decompress(payload, ctx)
    if stats is not None:
        stats.stop(span, "decompress")
        stats.record(x.numel() * x.element_size(), payload.nbytes)
        if measure:
            stats.record_error(x, y)
    return y


class _BoundaryFn(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, x: Tensor, act: Compressor | None, grad: Compressor | None,
                act_ctx: Context, grad_ctx: Context, stats: dict[str, DirectionStats] | None, measure: bool) -> Tensor:
        fctx.grad, fctx.grad_ctx, fctx.stats, fctx.act, fctx.act_ctx = grad, grad_ctx, stats, act, act_ctx
        fctx.measure = measure
        y = _roundtrip(act, x, act_ctx, stats["act"] if stats else None, measure)
        return y.clone() if y is x else y

    @staticmethod
    def backward(fctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        g = _roundtrip(fctx.grad, g.contiguous(), fctx.grad_ctx, fctx.stats["grad"] if fctx.stats else None,
                       fctx.measure)
        if fctx.act is not None and fctx.act_ctx.training:
            fctx.act.observe(g, fctx.act_ctx)  # what the sender of the activation receives back (mdtopk learns from it)
        return g, None, None, None, None, None, None


def compressed_boundary(x: Tensor, act: Compressor | None, grad: Compressor | None,
                        act_ctx: Context | None = None, grad_ctx: Context | None = None,
                        stats: dict[str, DirectionStats] | None = None, measure: bool = True) -> Tensor:
    """x -> D(C_act(x)) forward; g -> D(C_grad(g)) backward. None means uncompressed. With `stats`, the messages are
    counted there, and with `measure` their relative error too."""
    act_ctx = act_ctx or Context(direction="act")
    grad_ctx = grad_ctx or act_ctx.replace(direction="grad", name=act_ctx.name.replace(".act", ".grad"))
    return _BoundaryFn.apply(x, act, grad, act_ctx, grad_ctx, stats, measure)


class CompressionBoundary(nn.Module):
    """One stage boundary, simulated in process. Its state (step, EF buffers) is in state_dict."""

    def __init__(self, cfg: CompressionConfig | str, boundary: int = 0, name: str | None = None) -> None:
        super().__init__()
        self.cfg = parse_spec(cfg) if isinstance(cfg, str) else cfg
        if self.cfg.auto:
            raise ValueError(f"{self.cfg.auto} chooses each boundary's setting from its measured link; an in-process "
                             "boundary has no link. Use a fixed setting such as safe")
        self.boundary = boundary
        self.name = name or f"boundary{boundary}"
        self.policy = BoundaryPolicy(self.cfg)  # the same decisions as a pipeline's boundary
        self.ops = {d: self.policy.op(boundary, d, True) for d in ("act", "grad")}  # built now: bad specs fail here
        self.eval_op = self.policy.op(boundary, "act", False)
        self.stats = {"act": DirectionStats(), "grad": DirectionStats(), "eval": DirectionStats()}
        self.step = 0
        self.sample_ids: Tensor | None = None
        self.deferred = Deferred()
        """Non-finite verdicts of tensors on an accelerator: polled by each forward without waiting (they arrive a step
        or so later), all read by `check()`."""

    def check(self) -> None:
        """Raise the first failed non-finite check so far, waiting for the device if need be (on an accelerator they
        are not read per tensor, so that the host never waits mid-step; each forward polls those already on the
        host). Call it after the last step."""
        self.deferred.raise_pending()

    def _context(self, where: Where, sample_ids: Tensor | None, device: torch.device) -> Context:
        ctx = self.policy.context(where, 0, sample_ids, name=self.name)
        return ctx if device.type == "cpu" else ctx.replace(deferred=self.deferred)

    def forward(self, x: Tensor, sample_ids: Tensor | None = None) -> Tensor:
        self.deferred.poll()  # earlier steps' verdicts that have reached the host; never waits
        sample_ids = sample_ids if sample_ids is not None else self.sample_ids
        spec = TensorSpec(tuple(x.shape), x.dtype)
        if not self.training:
            where = Where(self.boundary, "act", self.step, training=False)
            return _roundtrip(self._plan(spec, where, "eval"), x, self._context(where, sample_ids, x.device),
                              self.stats["eval"], self.policy.measures_error(where))
        step, self.step = self.step, self.step + 1
        act_w, grad_w = Where(self.boundary, "act", step), Where(self.boundary, "grad", step)
        return compressed_boundary(x, self._plan(spec, act_w, "act"), self._plan(spec, grad_w, "grad"),
                                   self._context(act_w, sample_ids, x.device),
                                   self._context(grad_w, sample_ids, x.device), self.stats,
                                   self.policy.measures_error(act_w))

    def _plan(self, spec: TensorSpec, where: Where, key: str) -> Compressor | None:
        """The policy's operator for this tensor, counted in the statistics (a gradient is counted when its forward
        runs: it will cross with the same shape)."""
        op = self.policy.plan(spec, where)
        self.policy.account([spec], [op], where, self.stats[key], name=self.name)
        return op

    def get_extra_state(self) -> dict[str, Any]:
        return {"step": self.step, **self.policy.state_dict()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        try:
            self.policy.load_state_dict(state)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        self.step = int(state["step"])

    def extra_repr(self) -> str:
        return f"boundary={self.boundary}, cfg='{self.cfg}'"


class BlockWithBoundary(nn.Module):
    """A transformer block followed by a boundary on its hidden-state output."""

    def __init__(self, block: nn.Module, boundary: CompressionBoundary) -> None:
        super().__init__()
        self.block, self.boundary = block, boundary

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.block(*args, **kwargs)
        if isinstance(out, Tensor):
            return self.boundary(out)
        if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
            return (self.boundary(out[0]),) + out[1:]
        raise TypeError(f"{type(self.block).__name__} returned {type(out).__name__}; expected a Tensor or a tuple "
                        "starting with one")


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's main stack of blocks: the longest ModuleList whose items share one class."""
    best: nn.ModuleList | None = None
    for m in model.modules():
        if not isinstance(m, nn.ModuleList):
            continue
        kinds = {type(b.block if isinstance(b, BlockWithBoundary) else b) for b in m}
        if len(kinds) == 1 and len(m) >= 2:
            if best is None or len(m) > len(best):
                best = m
    if best is None:
        raise ValueError(f"no stack of blocks found in {type(model).__name__}; pass blocks=<the nn.ModuleList>")
    return best


def insert_boundaries(model: nn.Module, after: list[int], cfg: CompressionConfig | str,
                      blocks: nn.ModuleList | None = None) -> list[CompressionBoundary]:
    """Wrap blocks `after` (0-based) so their outputs cross a boundary; boundary j follows after[j]."""
    cfg = parse_spec(cfg) if isinstance(cfg, str) else cfg
    blocks = find_blocks(model) if blocks is None else blocks
    bad = [i for i in after if not 0 <= i < len(blocks)]
    if bad or len(set(after)) != len(after):
        raise ValueError(f"after={after}: block indices must be distinct, in 0..{len(blocks) - 1}")
    boundaries = []
    for j, i in enumerate(sorted(after)):
        if isinstance(blocks[i], BlockWithBoundary):
            raise ValueError(f"block {i} already has a boundary")
        boundaries.append(CompressionBoundary(cfg, boundary=j))
        blocks[i] = BlockWithBoundary(blocks[i], boundaries[-1])
    return boundaries


def set_sample_ids(model: nn.Module, ids: Tensor | None) -> None:
    """Sample ids of the next batch for every boundary in `model` (needed by +aqsgd)."""
    for m in model.modules():
        if isinstance(m, CompressionBoundary):
            m.sample_ids = ids
