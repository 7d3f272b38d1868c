"""Megatron-style tensor parallelism for the recipe's blocks, over torch.distributed (gloo on CPU, NCCL on GPUs).

A TPBlock holds 1/TP of a Block: its query/key/value projections and MLP gate/up are column-parallel (each rank
computes its own heads and its own slice of the MLP), the attention output and MLP down projections are
row-parallel (each rank's partial sum is all-reduced). The norms, the embedding and the head are replicated. Two
autograd functions carry Megatron's f and g operators: `_copy` is the identity forward and all-reduces the gradient
backward (where a replicated tensor enters column-parallel layers), `_reduce` all-reduces forward and is the identity
backward (after row-parallel layers).

Each TPBlock first builds the whole Block with the same random numbers as TP = 1 and keeps its slices, so a TP run
starts from exactly the weights of the TP = 1 run (the tests compare their losses). At scale one would initialise
the shards directly.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pp_lab.model import Block, GPTConfig


def topology(stages: int, tp: int) -> Any:
    """DeepSpeed's PP x TP x DP grid for the current world size."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    world = dist.get_world_size()
    if world % (stages * tp):
        raise ValueError(f"world size {world} is not a multiple of stages x tp = {stages} x {tp}")
    return PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=world // (stages * tp))


def tp_group(topo: Any) -> dist.ProcessGroup:
    """This rank's tensor-parallel group. Every rank creates every group, in the same order (new_group's contract)."""
    mine = None
    for ranks in topo.get_axis_comm_lists("model"):
        group = dist.new_group(ranks=ranks)
        if dist.get_rank() in ranks:
            mine = group
    if mine is None:
        raise RuntimeError(f"rank {dist.get_rank()} is in no tensor-parallel group of {topo}")
    return mine


class _Copy(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Reduce(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


def _keep(linear: nn.Linear, rows: slice | None = None, cols: slice | None = None, bias: bool = True) -> nn.Linear:
    """`linear` cut down in place to weight[rows, cols] (and bias[rows], or no bias). In place, not a new Linear:
    a new one would draw its own init from the global RNG and shift the next block's weights away from TP = 1's."""
    rows, cols = rows or slice(None), cols or slice(None)
    linear.weight = nn.Parameter(linear.weight.data[rows, cols].clone())
    linear.out_features, linear.in_features = linear.weight.shape
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].clone()) if bias else None
    return linear


class TPBlock(Block):
    """One tensor-parallel rank's share of a Block (see the module docstring)."""

    def __init__(self, cfg: GPTConfig, index: int, group: dist.ProcessGroup) -> None:
        super().__init__(cfg, index)  # the whole block, initialised as with TP = 1; then keep this rank's slices
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        if cfg.n_head % tp or cfg.kv_heads % tp or cfg.ff % tp:
            raise ValueError(f"tensor parallel size {tp} must divide n_head={cfg.n_head}, n_kv_head={cfg.kv_heads} and "
                             f"d_ff={cfg.ff}")
        self.group, self.n_head, self.n_kv = group, cfg.n_head // tp, cfg.kv_heads // tp
        hd, ff = cfg.head_dim, cfg.ff // tp
        q_rows, kv_rows = slice(r * self.n_head * hd, (r + 1) * self.n_head * hd), slice(r * self.n_kv * hd, (r + 1) * self.n_kv * hd)
        self.q, self.k, self.v = _keep(self.q, q_rows), _keep(self.k, kv_rows), _keep(self.v, kv_rows)
        o_bias = self.o.bias  # added once, after the all-reduce of the row-parallel partial sums
        self.o = _keep(self.o, cols=q_rows, bias=False)
        self.o_bias = o_bias
        ff_rows = slice(r * ff, (r + 1) * ff)
        if cfg.mlp == "swiglu":
            self.gate = _keep(self.gate, ff_rows)
        self.up = _keep(self.up, ff_rows)
        down_bias = self.down.bias
        self.down = _keep(self.down, cols=ff_rows, bias=False)
        self.down_bias = down_bias

    def attention(self, x: Tensor) -> Tensor:
        x = _Copy.apply(x, self.group)
        y = self.heads(x.transpose(0, 1), self.n_head, self.n_kv).transpose(0, 1) if self.cfg.layout == "sbh" \
            else self.heads(x, self.n_head, self.n_kv)  # partial sums of the output projection
        y = _Reduce.apply(y, self.group)
        return y if self.o_bias is None else y + self.o_bias

    def mlp(self, x: Tensor) -> Tensor:
        x = _Copy.apply(x, self.group)
        y = _Reduce.apply(super().mlp(x), self.group)  # the down projection's partial sums, all-reduced
        return y if self.down_bias is None else y + self.down_bias
