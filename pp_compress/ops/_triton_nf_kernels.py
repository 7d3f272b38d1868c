"""The Triton kernels of ops/triton_nf.py (imported only where Triton is installed; see there for what they do and
why they are the eager reference's bitwise)."""
import triton
import triton.language as tl

from ._triton_int_kernels import any_nonfinite, cast, splitmix


@triton.jit
def last_at_most(table_ptr, u, LOGL: tl.constexpr, STRICT: tl.constexpr):
    """Per value of u, the last index i of the ascending table (2**LOGL entries, table[0] <= every u) with
    table[i] <= u, or table[i] < u with STRICT: a branchless binary search, one gather per level."""
    pos = tl.zeros(u.shape, tl.int32)
    for s in tl.static_range(LOGL):
        cand = pos + (1 << (LOGL - 1 - s))
        t = tl.load(table_ptr + cand)
        if STRICT:
            pos = tl.where(t < u, cand, pos)
        else:
            pos = tl.where(t <= u, cand, pos)
    return pos


@triton.jit(do_not_specialize=["key", "slot_in", "slot_scale"])
def encode(x_ptr, lv_ptr, mid_ptr, codes_ptr, scale_ptr, flag_in_ptr, flag_scale_ptr, key, slot_in, slot_scale,
           G: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, BUMP: tl.constexpr, STOCH: tl.constexpr,
           FLAG_IN: tl.constexpr):
    """One group of G values: absmax, scale (rounded up to the scale dtype), u = x / scale clamped to [-1, 1], its
    level (nearest, or one of the two neighbours at random), packed codes."""
    grp = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    live = i < G
    x = tl.load(x_ptr + grp * G + i, mask=live, other=0.0).to(tl.float32)  # (BLOCK,)
    bad = any_nonfinite(tl.reshape(x, (1, BLOCK)))
    absmax = tl.max(tl.abs(x), axis=0)  # the device's max drops NaNs: `bad` looked for them
    scale = cast(absmax * (1.0 + BUMP), scale_ptr.dtype.element_ty)  # groups.round_scale
    tl.store(scale_ptr + grp, scale)
    s = scale.to(tl.float32)
    if FLAG_IN:  # x itself holds NaN/Inf: the compressor's input check
        tl.atomic_max(flag_in_ptr + slot_in, 1, mask=bad)
    # the reference's scale check: NaN from x's NaN/Inf, or an absmax beyond the scale dtype's range
    inf_or_nan = (s.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000  # all exponent bits set
    tl.atomic_max(flag_scale_ptr + slot_scale, 1, mask=bad | inf_or_nan)
    inv = tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0))
    u = tl.minimum(tl.maximum(x * inv, -1.0), 1.0)  # (BLOCK,)
    L: tl.constexpr = 1 << BITS
    if STOCH:  # between lv[lo] and lv[lo + 1], up with probability (u - lv[lo]) / (lv[lo + 1] - lv[lo])
        lo = tl.minimum(last_at_most(lv_ptr, u, BITS, False), L - 2)
        a = tl.load(lv_ptr + lo)
        p_up = tl.math.div_rn(u - a, tl.load(lv_ptr + lo + 1) - a)
        noise = (splitmix(grp * G + i, key) >> 40).to(tl.float32) * (2.0 ** -24)  # ops/noise.py's uniform
        code = lo + (noise < p_up).to(tl.int32)
    else:  # the nearest level: how many midpoints lie below u (the table starts with -inf)
        code = last_at_most(mid_ptr, u, BITS, True)
    if BITS == 8:
        tl.store(codes_ptr + grp * G + i, code.to(tl.uint8), mask=live)
    else:  # 8 codes -> BITS bytes of one little-endian word, first code in the lowest bits (ops/bits.py)
        c = tl.reshape(code.to(tl.uint64), (BLOCK // 8, 8))  # (words, 8)
        word = tl.sum(c << (tl.arange(0, 8) * BITS).to(tl.uint64)[None, :], axis=1)  # (words,)
        j = tl.arange(0, 8)[None, :]
        byte = ((word[:, None] >> (8 * j).to(tl.uint64)) & 0xFF).to(tl.uint8)  # (words, 8)
        w = tl.arange(0, BLOCK // 8)[:, None]
        tl.store(codes_ptr + grp * (G * BITS // 8) + w * BITS + j, byte, mask=(j < BITS) & (w < G // 8))


@triton.jit(do_not_specialize=["slot"])
def decode(codes_ptr, lv_ptr, scale_ptr, out_ptr, flag_ptr, slot, G: tl.constexpr, BLOCK: tl.constexpr,
           BITS: tl.constexpr, FLAG: tl.constexpr):
    """One group: unpack, look the levels up, multiply by the scale, write in the output dtype."""
    grp = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    live = i < G
    if BITS == 8:
        code = tl.load(codes_ptr + grp * G + i, mask=live, other=0).to(tl.int32)  # (BLOCK,)
    else:
        j = tl.arange(0, 8)[None, :]
        w = tl.arange(0, BLOCK // 8)[:, None]
        byte = tl.load(codes_ptr + grp * (G * BITS // 8) + w * BITS + j, mask=(j < BITS) & (w < G // 8), other=0)
        word = tl.sum(byte.to(tl.uint64) << (8 * j).to(tl.uint64), axis=1)  # (words,)
        c = (word[:, None] >> (j * BITS).to(tl.uint64)) & ((1 << BITS) - 1)  # (words, 8)
        code = tl.reshape(c.to(tl.int32), (BLOCK,))
    y = tl.load(lv_ptr + code) * tl.load(scale_ptr + grp).to(tl.float32)
    out = cast(y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + grp * G + i, out, mask=live)
    if FLAG:  # an output value not finite in the output's dtype: the decoder's own finiteness check
        tl.atomic_max(flag_ptr + slot, 1, mask=any_nonfinite(tl.reshape(tl.where(live, out.to(tl.float32), 0.0),
                                                                        (1, BLOCK))))
