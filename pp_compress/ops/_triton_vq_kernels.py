"""The Triton kernels of ops/triton_vq.py (imported only where Triton is installed; see there for what they do and
why they are the eager reference's bitwise)."""
import triton
import triton.language as tl

from ._triton_int_kernels import any_nonfinite, cast, rotate, row_signs, unrotate
from ._triton_pivoted_kernels import put_pivots, take_pivots


@triton.jit
def tree_sum(y, T: tl.constexpr, S: tl.constexpr, LOGS: tl.constexpr):
    """Each row of y (T, S) summed as ops/vq.py's `tree_sum`: the first half plus the second, until one is left."""
    for level in tl.static_range(LOGS):
        # the halves' sum, as a reduction of two terms (exactly a + b in any order): a split of a permuted block
        # here made Triton 3.6 hold the whole block in each thread's registers and spill it
        y = tl.sum(tl.reshape(y, (T, 2, S >> (level + 1))), axis=1)  # (T, S / 2**(level+1))
    return tl.reshape(y, (T,))


@triton.jit
def interleave(v0, v1, v2, v3, T: tl.constexpr, S: tl.constexpr, DIM: tl.constexpr):
    """Vectors of DIM consecutive values, given as coordinate arrays (T, S / DIM) (unused ones ignored), as (T, S)."""
    if DIM == 1:
        return v0
    elif DIM == 2:
        return tl.reshape(tl.join(v0, v1), (T, S))
    else:
        return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (T, S))


@triton.jit
def nearer(v, cb_ptr, i, DIM: tl.constexpr, best, code):
    """(best, code) updated with point i (a scalar or one per vector) where it is strictly nearer: the squared
    distance summed over coordinates in order, as ops/vq.py's `coord_distances`. v: DIM coordinate arrays."""
    e = v[0] - tl.load(cb_ptr + i * DIM)
    d = e * e
    for j in tl.static_range(1, DIM):
        e = v[j] - tl.load(cb_ptr + i * DIM + j)
        d = d + e * e
    closer = d < best
    return tl.where(closer, d, best), tl.where(closer, i, code)


@triton.jit(do_not_specialize=["rkey", "slot_in", "slot_ovf", "rows"])
def prepare(x_ptr, v_ptr, scale_ptr, vals_ptr, pos_ptr, flag_in_ptr, flag_ovf_ptr, signs_ptr, rkey, slot_in,
            slot_ovf, rows, D: tl.constexpr, TPR: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
            LOGS: tl.constexpr, CBMAX: tl.constexpr, K: tl.constexpr, ROT: tl.constexpr, INV: tl.constexpr,
            FLAG_IN: tl.constexpr, R: tl.constexpr, TABLE: tl.constexpr, SUMS: tl.constexpr):
    """R rows, one after the other: each one's pivots, rotation, per-tile scales and checks, and its tiles divided by
    their scales, written to v (rows, TPR * S) fp32 for `search`. The rotation's signs are the same for every row:
    computed once for the R rows."""
    t = tl.arange(0, T)[:, None]  # (T, 1) tiles of the row
    col = t * S + tl.arange(0, S)[None, :]  # (T, S) positions in the row, padded to whole tiles
    signs = row_signs(col, rkey, signs_ptr, ROT, TABLE)  # (T, S): once for the R rows
    for r in tl.static_range(R):
        row = tl.program_id(0).to(tl.int64) * R + r
        live = tl.zeros((T, S), tl.int64) + row < rows  # (T, S): false past the last row
        y = tl.load(x_ptr + row * D + col, mask=(col < D) & live, other=0.0).to(tl.float32)  # (T, S)
        bad = any_nonfinite(y)
        y = take_pivots(y, col, row, rows, vals_ptr, pos_ptr, D, T, S, K)  # ops/pivoted.py's `split`
        rest = any_nonfinite(y)  # a NaN/Inf left in a tile makes its scale NaN in the reference
        if ROT:
            y = rotate(y, signs, INV, T, S, LOGS, SUMS)
        # per tile: RMS scale, computed as (y / peak)^2 summed, / S, sqrt, * peak (no overflow on the way)
        peak = tl.maximum(tl.max(tl.abs(y), axis=1), 1.1754943508222875e-38)  # (T,) clamped to fp32's tiny
        q = tl.math.div_rn(y, peak[:, None])
        rms = tl.math.sqrt_rn(tl.math.div_rn(tree_sum(q * q, T, S, LOGS), S * 1.0)) * peak  # (T,)
        scale = cast(rms, scale_ptr.dtype.element_ty)
        tiles = tl.arange(0, T)
        tl.store(scale_ptr + row * TPR + tiles, scale, mask=(tiles < TPR) & (tiles * 0 + row < rows))
        s = scale.to(tl.float32)
        if FLAG_IN:  # x itself holds NaN/Inf: the compressor's input check
            tl.atomic_max(flag_in_ptr + slot_in, 1, mask=bad)
        ovf = rest | any_nonfinite(tl.reshape(s * CBMAX, (1, T)))  # the decoder's largest product overflows
        tl.atomic_max(flag_ovf_ptr + slot_ovf, 1, mask=ovf)
        y = tl.math.div_rn(y, tl.where(s > 0, s, 1.0)[:, None])
        tl.store(v_ptr + row * (TPR * S) + col, y, mask=(t < TPR) & live)


@triton.jit(do_not_specialize=["n"])
def search(v_ptr, cb_ptr, cand_ptr, codes_ptr, n, B: tl.constexpr, DIM: tl.constexpr, POINTS: tl.constexpr,
           CBITS: tl.constexpr, CELLS: tl.constexpr, KC: tl.constexpr, LO: tl.constexpr, INV_H: tl.constexpr):
    """B of the n vectors of v (n, DIM) fp32: each one's nearest codebook point, bit-packed. With CELLS, the pruned
    search (the vector's grid cell's KC candidates, ascending; a block with a vector beyond the grid searches every
    point instead); without, every point in index order. A strictly nearer point moves the choice either way: the
    lowest index on a tie, as argmin."""
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)  # (B,) vector indices
    live = i < n
    v0 = tl.load(v_ptr + i * DIM, mask=live, other=0.0)
    v1 = tl.load(v_ptr + i * DIM + 1, mask=live & (DIM > 1), other=0.0)
    v2 = tl.load(v_ptr + i * DIM + 2, mask=live & (DIM > 2), other=0.0)
    v3 = tl.load(v_ptr + i * DIM + 3, mask=live & (DIM > 3), other=0.0)
    v = (v0, v1, v2, v3)
    best = tl.full((B,), float("inf"), tl.float32)
    code = tl.zeros((B,), tl.int32)
    outside = 1
    if CELLS:
        cell = tl.zeros((B,), tl.int32)
        outside = 0
        for j in tl.static_range(DIM):
            f = (v[j] - LO) * INV_H
            cell = cell * CELLS + tl.minimum(tl.maximum(f, 0.0), CELLS - 1.0).to(tl.int32)  # last axis fastest
            outside = tl.maximum(outside, tl.max(((f < 0.0) | (f >= CELLS)).to(tl.int32), axis=0))
        for r in tl.static_range(KC):
            best, code = nearer(v, cb_ptr, tl.load(cand_ptr + cell * KC + r).to(tl.int32), DIM, best, code)
    if outside:
        best = tl.full((B,), float("inf"), tl.float32)
        for p in tl.range(POINTS):
            best, code = nearer(v, cb_ptr, p, DIM, best, code)
    if CBITS == 8:
        tl.store(codes_ptr + i, code.to(tl.uint8), mask=live)
    else:  # 8 codes -> CBITS bytes of one little-endian word, first code in the lowest bits (ops/bits.py)
        c = tl.reshape(code.to(tl.uint64), (B // 8, 8))  # (words, 8)
        word = tl.sum(c << (tl.arange(0, 8) * CBITS).to(tl.uint64)[None, :], axis=1)  # (words,)
        j = tl.arange(0, 8)[None, :]
        byte = ((word[:, None] >> (8 * j).to(tl.uint64)) & 0xFF).to(tl.uint8)  # (words, 8)
        w = tl.program_id(0).to(tl.int64) * (B // 8) + tl.arange(0, B // 8)[:, None]  # (words, 1) global word index
        tl.store(codes_ptr + w * CBITS + j, byte, mask=(j < CBITS) & (w < n // 8))


@triton.jit(do_not_specialize=["rkey", "slot", "rows"])
def decode(codes_ptr, cb_ptr, scale_ptr, vals_ptr, pos_ptr, out_ptr, flag_ptr, signs_ptr, rkey, slot, rows,
           D: tl.constexpr, TPR: tl.constexpr, T: tl.constexpr, S: tl.constexpr, LOGS: tl.constexpr,
           DIM: tl.constexpr, CBITS: tl.constexpr, K: tl.constexpr, ROT: tl.constexpr, INV: tl.constexpr,
           FLAG: tl.constexpr, R: tl.constexpr, TABLE: tl.constexpr, SUMS: tl.constexpr):
    t = tl.arange(0, T)[:, None]  # (T, 1)
    col = t * S + tl.arange(0, S)[None, :]  # (T, S)
    C: tl.constexpr = S // DIM
    tiles = tl.arange(0, T)
    signs = row_signs(col, rkey, signs_ptr, ROT, TABLE)  # (T, S): once for the R rows
    for r in tl.static_range(R):
        row = tl.program_id(0).to(tl.int64) * R + r
        if CBITS == 8:
            code = tl.load(codes_ptr + row * (TPR * C) + t * C + tl.arange(0, C)[None, :],
                           mask=(t < TPR) & (t * 0 + row < rows), other=0).to(tl.int32)  # (T, C)
        else:
            j = tl.arange(0, 8)[None, :]
            w = tl.arange(0, T * C // 8)[:, None]
            byte = tl.load(codes_ptr + row * (TPR * C * CBITS // 8) + w * CBITS + j,
                           mask=(j < CBITS) & (w < TPR * C // 8) & (w * 0 + row < rows), other=0)  # (words, 8)
            word = tl.sum(byte.to(tl.uint64) << (8 * j).to(tl.uint64), axis=1)  # (words,)
            code = tl.reshape(((word[:, None] >> (j * CBITS).to(tl.uint64)) & ((1 << CBITS) - 1)).to(tl.int32),
                              (T, C))
        v0 = tl.load(cb_ptr + code * DIM)  # (T, C) each: the points' coordinates
        v1, v2, v3 = v0, v0, v0
        if DIM > 1:
            v1 = tl.load(cb_ptr + code * DIM + 1)
        if DIM > 2:
            v2 = tl.load(cb_ptr + code * DIM + 2)
            v3 = tl.load(cb_ptr + code * DIM + 3)
        y = interleave(v0, v1, v2, v3, T, S, DIM)  # (T, S)
        y = y * tl.load(scale_ptr + row * TPR + tiles, mask=(tiles < TPR) & (tiles * 0 + row < rows),
                        other=0.0).to(tl.float32)[:, None]
        if ROT:
            y = unrotate(y, signs, INV, T, S, LOGS, SUMS)
        y = put_pivots(y, col, row, rows, vals_ptr, pos_ptr, K)
        out = cast(y, out_ptr.dtype.element_ty)
        live = (col < D) & (tl.zeros((T, S), tl.int64) + row < rows)  # (T, S)
        tl.store(out_ptr + row * D + col, out, mask=live)
        if FLAG:  # an output value not finite in the output's dtype: the decoder's own finiteness check
            tl.atomic_max(flag_ptr + slot, 1, mask=any_nonfinite(tl.where(live, out.to(tl.float32), 0.0)))
