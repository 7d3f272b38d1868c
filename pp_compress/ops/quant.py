"""int<b>: uniform b-bit quantization (b in 1..8), codes bit-packed on the wire.

Symmetric (default): levels -L..L with L = 2**(b-1) - 1 and scale = absmax / L per group (int8 codes travel
as two's-complement bytes, narrower codes offset by +L and bit-packed); for b = 1
the code is the sign and the scale is mean|x| (or absmax with stochastic rounding, which is then
unbiased). Asymmetric (`asym`): 2**b levels from the group's min (zero point) to its max.
Stochastic rounding (`stoch`) draws counter-based uniforms from the context (`ctx.uniform`) and is unbiased.
Rotation (`rot`): a randomized Hadamard transform over blocks of the last dim before quantizing and its inverse
after (ops/hadamard.py); the signs are counter-based from the context (the same on every device), so the wire is the
same as without it. It is linear, so stochastic rounding stays unbiased through it.
Wire: ceil(n * b / 8) bytes of codes + one scale per group (+ one zero point if asym).
"""
from __future__ import annotations

import functools
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from . import fused, hadamard, triton_int
from .bits import pack_bits, packed_nbytes, unpack_bits
from .base import (Compressor, Context, Layout, OpConfig, Payload, TensorSpec, expect_finite, input_message, new_flag,
                   settle)
from .groups import (PER_FORMS, SCALE_CODES, SCALE_DTYPES, block_size, check_kernel, check_per, check_scale,
                     div_exact, from_groups, group_dims, round_down, round_scale, safe_scale, to_groups)

INT_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
ROT_FORMS = "rot (auto) | rot=<power of two> | rot=off"


@dataclass(frozen=True)
class IntQuantConfig(OpConfig):
    """Uniform integer quantization, e.g. `int8`, `int4:per=block64`, `int2:asym:stoch:scale=fp32`."""

    NAME: ClassVar[str] = "int"
    FORMS: ClassVar[str] = (f"int<b>[:per=P][:asym][:stoch][:rot[=N]][:scale=S][:kernel=fused|eager][:compile], b in "
                            f"1..8, P = {PER_FORMS}")
    FLAGS: ClassVar[dict[str, str]] = {"rot": "auto"}
    EXAMPLES: ClassVar[tuple[str, ...]] = (
        "int8", "int8:per=tensor", "int8:per=channel", "int4:per=block64", "int4:asym", "int2", "int2:asym:stoch",
        "int1", "int1:stoch", "int8:scale=fp16", "int4:per=block32:scale=fp32", "int3", "int3:asym", "int5:stoch",
        "int6:per=block64", "int7:asym:stoch", "int4:rot", "int3:rot:per=block64", "int8:rot", "int2:rot=4:stoch",
        "int4:rot:asym:per=channel", "int1:rot", "int8:kernel=eager", "int3:per=block64:kernel=eager",
    )

    bits: int = 8
    """Bits per code, 1..8."""
    per: str = "row"
    """Scale granularity: tensor, row (last dim), channel (per feature over the batch dim), block<N>."""
    asym: bool = False
    """Asymmetric min/max quantization (scale + zero point per group) instead of symmetric absmax."""
    stoch: bool = False
    """Stochastic rounding (unbiased) instead of round-to-nearest."""
    scale: str = "bf16"
    """Dtype of scales and zero points on the wire: bf16 (default: fp32 range, so tiny gradients
    never underflow), fp16 (underflows below ~6e-8: avoid for gradients) or fp32."""
    rot: str = "off"
    """Randomized Hadamard rotation over blocks of the last dim: off; auto (bare `rot`: the largest power of two
    up to 256 that divides the last dim); or a block size, a power of two >= 2 that must divide the last dim."""
    kernel: str = "fused"
    """fused: on a CUDA device, one Triton kernel each way (ops/triton_int.py) for symmetric codes of 2..8 bits,
    nearest or stochastic, per row (with or without rotation) or per block that tiles the tensor (without); on CPU,
    the one-pass kernel (ops/fused.py) where this configuration has one: symmetric, nearest or stochastic (the same
    draws), per row or per block of a multiple of 8 values that tile the tensor, and the Hadamard rotation (blocks
    of a multiple of 8), in the same pass where groups and blocks nest (one size divides the other); the codes are
    bitwise the reference's.
    eager: always the reference tensor code."""
    compile: bool = False
    """Run the symmetric round-to-nearest kernels through torch.compile (fused passes: ~3x faster int8
    encode on CPU, measured in benchmarks/ops.py); the first call per shape compiles. Where compiling
    fails, a warning says why and the same kernels run eagerly. The bytes on the wire do not change."""

    def __post_init__(self) -> None:
        if self.bits not in INT_BITS:
            raise ValueError(f"int bits={self.bits}; accepted: {', '.join(map(str, INT_BITS))}")
        check_per(self.per)
        check_scale(self.scale)
        check_kernel(self.kernel)
        if self.rot not in ("off", "auto") and not (self.rot.isdigit() and int(self.rot) >= 2
                                                    and not int(self.rot) & (int(self.rot) - 1)):
            raise ValueError(f"rot={self.rot!r}; accepted: {ROT_FORMS}")

    def rot_block(self, shape: tuple[int, ...], where: str) -> int:
        """Hadamard block size for a tensor of `shape` (0 = no rotation); ValueError where it cannot apply."""
        return 0 if self.rot == "off" else _rot_block(self.rot, self.bits, tuple(shape), where)

    @classmethod
    def from_name(cls, name: str) -> dict[str, Any] | None:
        m = re.fullmatch(r"int(\d+)", name)
        if not m:
            return None
        bits = int(m.group(1))
        if bits not in INT_BITS:
            raise ValueError(f"unsupported bit width in {name!r}; accepted: int1 .. int8")
        return {"bits": bits}

    def spec_name(self) -> str:
        return f"int{self.bits}"

    def build(self) -> "IntQuant":
        return IntQuant(self)


@functools.lru_cache(maxsize=1024)  # asked several times per message, for a handful of shapes
def _rot_block(rot: str, bits: int, shape: tuple[int, ...], where: str) -> int:
    n = hadamard.auto_block(shape[-1] if shape else 1) if rot == "auto" else int(rot)
    hadamard.check_block(n, shape, f"{where}: int{bits}:rot={rot}")
    return n


class IntQuant(Compressor):
    config: IntQuantConfig

    def batch_grouped(self) -> bool:
        return self.config.per == "channel"

    def wire_layout(self, shape: tuple[int, ...], dtype: torch.dtype, ctx: Context | None = None) -> Layout:
        c = self.config
        numel = TensorSpec(tuple(shape), dtype).numel
        groups, _ = group_dims(tuple(shape), c.per)
        sdt = SCALE_DTYPES[c.scale]
        layout = [TensorSpec((packed_nbytes(numel, c.bits),), torch.uint8), TensorSpec((groups,), sdt)]
        if c.asym:
            layout.append(TensorSpec((groups,), sdt))
        return layout

    def encode_rows(self, x: Tensor, rows: Tensor, ctx: Context) -> Payload:
        """`encode(x[rows], ctx)` for x (n, last) and int64 row indices: the device kernels read the rows where they
        are, without the gathered copy (`tile`'s high and low tiles)."""
        return self._encode(x, ctx, rows) if rows.numel() else self.encode(x[rows], ctx)

    def decode_rows(self, payload: Payload, out: Tensor, rows: Tensor, ctx: Context) -> None:
        """out[rows] = decode(payload, ctx), for out (n, last) in the payload's dtype: the device kernels write the
        rows where they go, without the decoded copy."""
        shape = tuple(payload.shape)
        n = self.config.rot_block(shape, ctx.name)
        if rows.numel() and self.config.per == "row" and self._on_device(payload.tensors[0], shape[-1], n):
            self._device_decode(payload, (rows.numel(), shape[-1]), n, ctx, (out, rows))
        else:
            out[rows] = self.decode(payload, ctx)

    def _encode(self, x: Tensor, ctx: Context, rows: Tensor | None = None) -> Payload:
        c = self.config
        shape = tuple(x.shape) if rows is None else (rows.numel(), x.shape[-1])  # what is encoded: x, or x[rows]
        n = c.rot_block(shape, ctx.name)
        row = self._device_row(shape, n)
        on_device = self._on_device(x, row, n) and (rows is None or c.per == "row")
        if rows is not None and not on_device:
            x, rows = x[rows], None
        size = 0 if on_device else self._fused_rot_size(tuple(x.shape), x, n)
        if on_device:  # one kernel: [rotation], scales, rounding, packing
            key = ctx.noise_key("int") if c.stoch else None
            flag = new_flag(ctx, x.device, FloatingPointError, input_message(ctx)) if (
                self.nonfinite == "raise" and self._kernel_checks_input()) else None
            codes, scale = triton_int.sym_encode(x.reshape(-1, row), c.bits, SCALE_DTYPES[c.scale], n,
                                                 ctx.noise_key("rot") if n else 0, key, flag, rows)
            p = Payload((codes, scale), torch.Size(shape), x.dtype)
            if flag is not None:
                settle(flag, ctx)
                return p
        elif size:  # one pass: each unit rotated in cache and quantized from there (the same codes as below)
            d = hadamard.signs(x.shape[-1], ctx.noise_key("rot"), x.device)  # (last,)
            key = ctx.noise_key("int") if c.stoch else None
            codes, scale = fused.kernels().rot_sym_encode(x.contiguous(), d, n, size, c.bits, SCALE_CODES[c.scale], key)
            p = Payload((codes, scale.to(SCALE_DTYPES[c.scale])), x.shape, x.dtype)
        elif n:
            y = hadamard.rotate(x, n, ctx.noise_key("rot"), c.kernel == "fused")  # x.shape, fp32, a fresh tensor
            p = Payload(self._quantize(y, ctx).tensors, x.shape, x.dtype)
        else:
            p = self._quantize(x, ctx)
        spec, scale = self.spec, self.config.scale
        for t in p.tensors[1:]:  # scales (and zero points): tiny
            expect_finite(t, ctx, FloatingPointError, lambda: (
                f"{ctx.name}: {spec} scales overflow scale={scale} at step {ctx.step}; use a wider scale: "
                "scale=bf16 or scale=fp32"), lambda: f" (max |x| {float(x.abs().max()):.4g} in {x.dtype})")
        return p

    def _decode(self, payload: Payload, ctx: Context) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        n = c.rot_block(shape, ctx.name)
        codes = payload.tensors[0]
        row = self._device_row(shape, n)
        if self._on_device(codes, row, n):
            rows_shape = (math.prod(shape) // row, row)
            return self._device_decode(payload, rows_shape, n, ctx).reshape(shape)
        if not n:
            return self._dequantize(payload)
        if size := self._fused_rot_size(shape, payload.tensors[0], n):
            d = hadamard.signs(shape[-1], ctx.noise_key("rot"), payload.tensors[0].device)
            like = payload.tensors[0].new_empty(0, dtype=payload.dtype)
            return fused.kernels().rot_sym_decode(payload.tensors[0], payload.tensors[1].float(), d, n, c.bits, size,
                                                  like).reshape(shape)
        y = self._dequantize(Payload(payload.tensors, payload.shape, torch.float32))  # rotated values, fp32
        return hadamard.unrotate(y, n, ctx.noise_key("rot"), payload.dtype, self.config.kernel == "fused")

    def _device_decode(self, payload: Payload, rows_shape: tuple[int, int], n: int, ctx: Context,
                       into: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The device kernel's decode of `payload` as rows (rows, row), with its output check: into a new tensor, or
        with `into` = (out, rows) into out[rows]."""
        c = self.config
        message = self.output_message(ctx, payload.dtype)
        device = payload.tensors[0].device
        flag = new_flag(ctx, device, FloatingPointError, message) if self.nonfinite == "raise" else None
        out = triton_int.sym_decode(payload.tensors[0], payload.tensors[1], rows_shape, payload.dtype, c.bits, n,
                                    ctx.noise_key("rot") if n else 0, flag, into)
        if flag is not None:
            settle(flag, ctx)
        return out

    def screens_input(self, x: Tensor) -> bool:
        n = self._rot(x.shape)
        return self._kernel_checks_input() and self._on_device(x, self._device_row(tuple(x.shape), n), n)

    def _kernel_checks_input(self) -> bool:
        """Whether the device kernel's NaN/Inf flag stands for compress's input check: with bf16 or fp32 scales,
        which cannot overflow, a flagged row can only be one of x's own (fp16 scales need the scales' check too)."""
        return self.config.scale != "fp16"

    def screens_output(self, payload: Payload) -> bool:
        shape = tuple(payload.shape)
        n = self._rot(shape)
        return bool(payload.tensors) and self._on_device(payload.tensors[0], self._device_row(shape, n), n)

    def _rot(self, shape: tuple[int, ...]) -> int:
        """The rotation block for `shape`, 0 where none fits (the operator's own call then names the error)."""
        try:
            return self.config.rot_block(tuple(shape), "")
        except ValueError:
            return 0

    def _device_row(self, shape: tuple[int, ...], n: int) -> int:
        """The rows the device kernels would take a tensor of `shape` in (0: none): its last dim per row; blocks of N
        per block<N> without rotation, where they tile the tensor (a block of the flattened tensor is then a row of
        its own, with the same codes, scales and noise positions)."""
        c = self.config
        if c.per == "row":
            return shape[-1] if shape else 1
        size = block_size(c.per)
        return size if size and not n and TensorSpec(shape, torch.float32).numel % size == 0 else 0

    def _on_device(self, like: Tensor, row: int, n: int) -> bool:
        """Whether the device kernels (ops/triton_int.py) encode and decode this tensor: symmetric codes per row of
        `row` values (`_device_row`)."""
        c = self.config
        return (c.kernel == "fused" and row > 0 and not (c.asym or c.compile)
                and triton_int.usable(like, row, c.bits, n))

    def _fused_size(self, shape: tuple[int, ...], like: Tensor) -> int:
        """The group size when the fused kernel takes this tensor (0 when the reference runs)."""
        c = self.config
        if c.kernel != "fused" or c.asym or c.compile or c.bits == 1 or c.per == "channel":
            return 0
        groups, size = group_dims(shape, c.per)
        return size if groups * size == TensorSpec(shape, like.dtype).numel and fused.usable(like, size) else 0

    def _fused_rot_size(self, shape: tuple[int, ...], like: Tensor, n: int) -> int:
        """The group size when the one-pass rotate-and-quantize kernel takes this tensor (0: rotation, then
        quantization, as separate passes): groups and rotation blocks of which one divides the other."""
        size = self._fused_size(shape, like) if n else 0
        return size if size and (size % n == 0 or n % size == 0) and fused.usable(like, n) else 0

    def _quantize(self, x: Tensor, ctx: Context) -> Payload:
        c = self.config
        sdt = SCALE_DTYPES[c.scale]
        size = self._fused_size(tuple(x.shape), x)
        if size:  # one pass per group: absmax, scale, rounding (with ctx.uniform's draws), packing
            g = x.reshape(-1, size).contiguous()  # (groups, size)
            key = ctx.noise_key("int") if c.stoch else None  # the kernel draws ctx.uniform's values in place
            codes, scale = fused.kernels().sym_encode(g, c.bits, SCALE_CODES[c.scale], key)
            return Payload((codes, scale.to(sdt)), x.shape, x.dtype)
        if c.bits == 8 and not (c.asym or c.stoch or c.compile):  # the hot path: chunked, no fp32 copy of x
            codes, scale = sym_encode_int8(to_groups(x, c.per), sdt)  # (groups, size) int8, (groups,)
            codes = from_groups(codes, tuple(x.shape), c.per).view(torch.uint8)  # x.shape, two's complement
            return Payload((codes.reshape(-1), scale), x.shape, x.dtype)
        g = to_groups(x, c.per).float()  # (groups, size); a view of x when x is fp32: never modified in place
        noise = None
        if c.stoch:
            noise = ctx.uniform(g.shape, x.device, "int")  # (groups, size)
        if c.asym or c.stoch or c.bits == 1:
            lo, hi = g.amin(dim=1), g.amax(dim=1)  # (groups,) each; two vectorized passes beat aminmax ~10x on CPU
        if c.asym:
            top = 2**c.bits - 1
            zero = round_down(lo, sdt)  # (groups,)
            # hi / top - zero / top, not (hi - zero) / top: the span of values near the dtype's max overflows
            scale = round_scale(hi / top - zero.float() / top, sdt)  # (groups,)
            inv = 1 / safe_scale(scale)  # (groups,)
            q = torch.mul(g, inv[:, None]).sub_((zero.float() * inv)[:, None])  # (groups, size), in [0, top]
            codes = _round_(q, noise).clamp_(0, top)  # the split division may land a rounding step outside
            extra: tuple[Tensor, ...] = (scale, zero)
        elif c.bits == 1:
            scale = round_scale(torch.maximum(hi, -lo) if c.stoch else _abs_mean(g), sdt)  # (groups,)
            if noise is None:
                codes = (g >= 0).float()
            else:  # P(+1) = (x / absmax + 1) / 2: unbiased
                codes = (noise < (g / safe_scale(scale)[:, None] + 1) / 2).float()
            extra = (scale,)
        else:
            if c.stoch:
                top = 2 ** (c.bits - 1) - 1
                scale = round_scale(div_exact(torch.maximum(hi, -lo), top), sdt)  # (groups,)
                # floor(q + u) may reach top + 1 through fp32 rounding of the sum: clamp
                q = _round_(torch.div(g, safe_scale(scale)[:, None]), noise).clamp_(-top, top)  # (groups, size)
                codes = q.to(torch.int8) if c.bits == 8 else q.add_(top)
            else:
                codes, scale = (_SYM_ENCODE if c.compile else sym_encode)(g, c.bits, sdt)  # (groups, size), (groups,)
            extra = (scale,)
            if c.bits == 8:  # two's complement bytes: no offset pass on either side
                codes = from_groups(codes, tuple(x.shape), c.per).view(torch.uint8)  # x.shape
                return Payload((codes.reshape(-1),) + extra, x.shape, x.dtype)
        codes = from_groups(codes, tuple(x.shape), c.per).to(torch.uint8)  # x.shape
        return Payload((pack_bits(codes, c.bits),) + extra, x.shape, x.dtype)

    def _dequantize(self, payload: Payload) -> Tensor:
        c = self.config
        shape = tuple(payload.shape)
        size = self._fused_size(shape, payload.tensors[0])
        if size:
            like = payload.tensors[0].new_empty(0, dtype=payload.dtype)
            scale = payload.tensors[1].float()
            return fused.kernels().sym_decode(payload.tensors[0], scale, c.bits, size, like).reshape(shape)
        numel = TensorSpec(shape, payload.dtype).numel
        codes = unpack_bits(payload.tensors[0], c.bits, numel).reshape(shape)
        if c.bits == 8 and not c.asym:
            codes = codes.view(torch.int8)  # symmetric int8 travels as two's complement
        scale = payload.tensors[1].float()[:, None]  # (groups, 1)
        if not c.asym and c.bits > 1:
            codes = to_groups(codes, c.per)  # (groups, size)
            if c.compile:
                g = _SYM_DECODE(codes, c.bits, scale, payload.dtype)
            else:
                g = (sym_decode_int8(codes, scale, payload.dtype) if c.bits == 8
                     else sym_decode(codes, c.bits, scale, payload.dtype))
            return from_groups(g, shape, c.per)
        g = to_groups(codes, c.per).float()  # (groups, size), a fresh fp32 tensor: updated in place below
        if c.asym:  # zero + code * scale as mid + (code - top / 2) * scale: no overflow near the dtype's max
            half = (2**c.bits - 1) / 2
            g.sub_(half).mul_(scale).add_(payload.tensors[2].float()[:, None] + half * scale)
        else:
            g.mul_(2).sub_(1).mul_(scale)
        return from_groups(g, shape, c.per).to(payload.dtype)


def sym_encode(g: Tensor, bits: int, sdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Symmetric round-to-nearest codes of fp32 groups g (groups, size): int8 values for bits == 8, else
    codes offset to 0..2L as fp32; and the scales in `sdt`. Scales are rounded up, so |g / scale| <= L and
    no clamp is needed. Pure tensor code: torch.compile fuses it (`compile` option)."""
    top = 2 ** (bits - 1) - 1
    scale = round_scale(div_exact(torch.maximum(g.amax(dim=1), -g.amin(dim=1)), top), sdt)  # (groups,)
    q = torch.div(g, safe_scale(scale)[:, None]).round_()  # (groups, size)
    return (q.to(torch.int8) if bits == 8 else q.add_(top)), scale


def sym_decode(codes: Tensor, bits: int, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of sym_encode: codes (groups, size) as received (int8, or uint8 offset by L), fp32 scales
    (groups, 1) -> values in `dtype`."""
    q = codes.float()  # (groups, size), a fresh tensor: updated in place
    q = q.mul_(scale) if bits == 8 else q.sub_(2 ** (bits - 1) - 1).mul_(scale)
    return q.to(dtype)


# Elements per chunk of the eager int8 kernels on CPU: fp32 temporaries of 1 MiB stay in cache and are reused,
# where whole-tensor temporaries cost a page fault per 4 KiB (3.5x faster encode on 8x1024x2048 here).
CHUNK = 1 << 18


def _chunk_rows(g: Tensor) -> int:
    """Rows per chunk for the eager int8 kernels, or 0 where chunking does not pay (GPU, small, strided)."""
    groups, size = g.shape
    rows = max(1, CHUNK // max(size, 1))
    return rows if g.device.type == "cpu" and groups > rows and g.is_contiguous() else 0


def sym_encode_int8(g: Tensor, sdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """sym_encode(g.float(), 8, sdt), bitwise, for g (groups, size) in its own dtype: on CPU one chunk of rows
    at a time through a reused fp32 buffer, so the input is read once (its row maxima are taken from the
    cached fp32 chunk: bf16 reductions are 4x slower than fp32 here) and no full-size temporary is made."""
    rows = _chunk_rows(g)
    if not rows:
        return sym_encode(g.float(), 8, sdt)
    scale = torch.empty(g.shape[0], dtype=sdt, device=g.device)  # (groups,)
    codes = torch.empty(g.shape, dtype=torch.int8, device=g.device)  # (groups, size)
    buf = torch.empty((rows, g.shape[1]), dtype=torch.float32, device=g.device)  # (rows, size)
    for i in range(0, g.shape[0], rows):
        b = buf[: min(rows, g.shape[0] - i)].copy_(g[i:i + rows])  # (<=rows, size); exact
        s = round_scale(div_exact(torch.maximum(b.amax(dim=1), -b.amin(dim=1)), 127), sdt)  # (<=rows,)
        scale[i:i + rows] = s
        b.div_(safe_scale(s)[:, None]).round_()
        codes[i:i + rows].copy_(b)  # integral floats in -127..127: exact
    return codes, scale


def sym_decode_int8(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """sym_decode(codes, 8, scale, dtype), bitwise, chunked like sym_encode_int8: int8 codes (groups, size),
    fp32 scales (groups, 1)."""
    rows = _chunk_rows(codes)
    if not rows:
        return sym_decode(codes, 8, scale, dtype)
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)  # (groups, size)
    buf = torch.empty((rows, codes.shape[1]), dtype=torch.float32, device=codes.device)  # (rows, size)
    for i in range(0, codes.shape[0], rows):
        b = out[i:i + rows] if dtype == torch.float32 else buf[: min(rows, codes.shape[0] - i)]  # (<=rows, size)
        b.copy_(codes[i:i + rows]).mul_(scale[i:i + rows])
        if dtype != torch.float32:
            out[i:i + rows].copy_(b)
    return out


class Compiled:
    """`fn` through torch.compile, built on first use. Where compiling or running the compiled code fails
    (no C++ compiler, unsupported platform), it warns once with the reason and runs `fn` eagerly from then on."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.compiled, self.failed = fn, None, False

    def __call__(self, *args: Any) -> Any:
        if not self.failed:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=False)
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: say so, then run eagerly
                self.failed = True
                warnings.warn(f"pp_compress: torch.compile of {self.fn.__name__} failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); running it eagerly", RuntimeWarning, stacklevel=2)
        return self.fn(*args)


_SYM_ENCODE, _SYM_DECODE = Compiled(sym_encode), Compiled(sym_decode)


def _abs_mean(g: Tensor) -> Tensor:
    """mean |g| per row of fp32 groups (groups, size); rows whose sum overflows fp32 take it scaled by their max
    (computed for every row: asking whether any overflowed would wait for the device)."""
    a = g.abs()  # (groups, size)
    mean = a.mean(dim=1)  # (groups,)
    top = a.amax(dim=1)  # (groups,)
    return torch.where(torch.isfinite(mean), mean, (a / safe_scale(top)[:, None]).mean(dim=1) * top)


def _round_(q: Tensor, noise: Tensor | None) -> Tensor:
    """Round q in place: to nearest, or stochastically (floor(q + U[0,1)))."""
    return q.round_() if noise is None else q.add_(noise).floor_()
