"""The Triton kernels of ops/triton_pivoted.py, and the pivot helpers that vq's kernels share (imported only where
Triton is installed; see there for what they do and why they are the eager reference's bitwise)."""
import triton
import triton.language as tl

from ._triton_int_kernels import cast, rotate, row_signs, unrotate


@triton.jit
def take_pivots(y, col, row, rows, vals_ptr, pos_ptr, D: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
                K: tl.constexpr):
    """y (T, S) of one row with its K largest |values| zeroed, each written exactly (in vals' dtype) with its int16
    position: the lowest position first among equals, NaN above all (ops/pivoted.py's `split`, argmax's order),
    compared as the integers of their bits, which order non-negative floats and put NaN above Inf."""
    bits = y.to(tl.int32, bitcast=True)  # (T, S)
    a = tl.where(col < D, bits & 0x7FFFFFFF, -1)  # (T, S): |y|'s bits, -1 for padding and pivots taken
    for j in tl.static_range(K):
        top = tl.max(tl.max(a, axis=1), axis=0)
        p = tl.min(tl.min(tl.where(a == top, col, T * S), axis=1), axis=0)
        here = col == p  # (T, S)
        v = tl.max(tl.max(tl.where(here, bits, -2147483648), axis=1), axis=0)  # y[p]'s bits, a NaN's and -0's too
        tl.store(vals_ptr + row * K + j, v.to(tl.float32, bitcast=True).to(vals_ptr.dtype.element_ty),
                 mask=row < rows)
        tl.store(pos_ptr + row * K + j, p.to(tl.int16), mask=row < rows)
        a = tl.where(here, -1, a)
        y = tl.where(here, 0.0, y)
    return y


@triton.jit
def put_pivots(y, col, row, rows, vals_ptr, pos_ptr, K: tl.constexpr):
    """y (T, S) of one row with its K pivots put back (their values in fp32): the inverse of take_pivots."""
    for k in tl.static_range(K):
        p = tl.load(pos_ptr + row * K + k, mask=row < rows, other=0).to(tl.int32)
        y = tl.where(col == p, tl.load(vals_ptr + row * K + k, mask=row < rows, other=0.0).to(tl.float32), y)
    return y


@triton.jit(do_not_specialize=["rkey", "rows"])
def split(x_ptr, t_ptr, vals_ptr, pos_ptr, signs_ptr, rkey, rows, D: tl.constexpr, TPR: tl.constexpr,
          T: tl.constexpr, S: tl.constexpr, LOGS: tl.constexpr, K: tl.constexpr, ROT: tl.constexpr,
          INV: tl.constexpr, R: tl.constexpr, TABLE: tl.constexpr, SUMS: tl.constexpr):
    """R rows, one after the other: each one's pivots taken out, [x / sqrt(S) * signs, butterfly] per tile, its tiles
    written to t (rows, TPR * S) fp32."""
    t = tl.arange(0, T)[:, None]  # (T, 1) tiles of the row
    col = t * S + tl.arange(0, S)[None, :]  # (T, S) positions in the row, padded to whole tiles
    signs = row_signs(col, rkey, signs_ptr, ROT, TABLE)  # (T, S): once for the R rows
    for r in tl.static_range(R):
        row = tl.program_id(0).to(tl.int64) * R + r
        live = tl.zeros((T, S), tl.int64) + row < rows  # (T, S): false past the last row
        y = tl.load(x_ptr + row * D + col, mask=(col < D) & live, other=0.0).to(tl.float32)  # (T, S)
        y = take_pivots(y, col, row, rows, vals_ptr, pos_ptr, D, T, S, K)
        if ROT:
            y = rotate(y, signs, INV, T, S, LOGS, SUMS)
        tl.store(t_ptr + row * (TPR * S) + col, y, mask=(t < TPR) & live)


@triton.jit(do_not_specialize=["rkey", "rows"])
def merge(t_ptr, vals_ptr, pos_ptr, out_ptr, signs_ptr, rkey, rows, D: tl.constexpr, TPR: tl.constexpr,
          T: tl.constexpr, S: tl.constexpr, LOGS: tl.constexpr, K: tl.constexpr, ROT: tl.constexpr,
          INV: tl.constexpr, R: tl.constexpr, TABLE: tl.constexpr, SUMS: tl.constexpr):
    """The inverse of `split`: R rows of tiles t (rows, TPR * S) fp32 -> [butterfly(t / sqrt(S)) * signs], the pivots
    put back, written to out (rows, D) in its dtype."""
    t = tl.arange(0, T)[:, None]  # (T, 1)
    col = t * S + tl.arange(0, S)[None, :]  # (T, S)
    signs = row_signs(col, rkey, signs_ptr, ROT, TABLE)  # (T, S): once for the R rows
    for r in tl.static_range(R):
        row = tl.program_id(0).to(tl.int64) * R + r
        live = tl.zeros((T, S), tl.int64) + row < rows  # (T, S)
        y = tl.load(t_ptr + row * (TPR * S) + col, mask=(t < TPR) & live, other=0.0)  # (T, S)
        if ROT:
            y = unrotate(y, signs, INV, T, S, LOGS, SUMS)
        y = put_pivots(y, col, row, rows, vals_ptr, pos_ptr, K)
        tl.store(out_ptr + row * D + col, cast(y, out_ptr.dtype.element_ty), mask=(col < D) & live)
