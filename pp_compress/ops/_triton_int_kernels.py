"""The Triton kernels of ops/triton_int.py (imported only where Triton is installed; see there for what they do and
why they are the eager reference's bitwise)."""
import triton
import triton.language as tl


@triton.jit
def butterfly(y, P: tl.constexpr, N: tl.constexpr, LOGN: tl.constexpr, SUMS: tl.constexpr):
    """The Walsh-Hadamard butterfly over each row of y (P, N), N = 2**LOGN: LOGN add/subtract levels, lowest
    index bit first (the eager reference's order). Each level pairs a = y[i] with b = y[i + h] (bit `level` of i
    clear) and puts a + b at i, a - b at i + h. Two spellings of the same arithmetic, which Triton lays out in
    registers differently (`triton_int.BUTTERFLY`): the pair's axis moved last and split (its layout conversions go
    through shared memory), or with SUMS, a + b and a + (-b) as sums over the pair's axis where it lies (a sum of two
    terms is exactly a + b in either order, and a - b is a + (-b) in IEEE arithmetic, so the bits are the same), which
    needs warp shuffles instead."""
    for level in tl.static_range(LOGN):  # half-blocks of h = 2**level values
        if SUMS:
            v = tl.reshape(y, (P, N >> (level + 1), 2, 1 << level))  # (P, pairs, 2, h)
            second = (tl.arange(0, 2) == 1)[None, None, :, None]  # (1, 1, 2, 1): b's place
            total = tl.sum(v, axis=2, keep_dims=True)  # (P, pairs, 1, h): a + b
            diff = tl.sum(tl.where(second, -v, v), axis=2, keep_dims=True)  # (P, pairs, 1, h): a - b
            y = tl.reshape(tl.where(second, diff, total), (P, N))
        else:
            v = tl.permute(tl.reshape(y, (P, N >> (level + 1), 2, 1 << level)), (0, 1, 3, 2))  # (P, pairs, h, 2)
            a, b = tl.split(v)  # (P, pairs, h) each
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (P, N))
    return y


@triton.jit
def rotate(y, signs, INV: tl.constexpr, P: tl.constexpr, N: tl.constexpr, LOGN: tl.constexpr, SUMS: tl.constexpr):
    """The randomized Hadamard transform of each row of y (P, N): y / sqrt(N) * signs, then the butterfly (the eager
    reference's order: ops/hadamard.py)."""
    y = y * INV
    y = y * signs
    return butterfly(y, P, N, LOGN, SUMS)


@triton.jit
def unrotate(y, signs, INV: tl.constexpr, P: tl.constexpr, N: tl.constexpr, LOGN: tl.constexpr, SUMS: tl.constexpr):
    """The inverse of `rotate`: the butterfly of y / sqrt(N), then * signs."""
    return butterfly(y * INV, P, N, LOGN, SUMS) * signs


@triton.jit
def cast(y, dtype: tl.constexpr):
    """fp32 y in `dtype`, rounded to nearest even as torch's casts; bf16 by integer arithmetic, because Triton's
    interpreter truncates there (NaN stays NaN: its top bits do not change)."""
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(dtype)


@triton.jit
def splitmix(i, key):
    """ops/noise.py's counter-based stream: splitmix64(key + (i + 1) * GAMMA), uint64, for int positions i."""
    z = (i + 1).to(tl.uint64) * 0x9E3779B97F4A7C15 + key.to(tl.uint64)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def rot_signs(col, rkey):
    """ops/noise.py's signs: +1 where the stream's top bit is set, else -1, at row positions col."""
    return (splitmix(col, rkey) >> 63).to(tl.float32) * 2.0 - 1.0


@triton.jit
def row_signs(col, rkey, signs_ptr, ROT: tl.constexpr, TABLE: tl.constexpr):
    """The rotation's signs at row positions col (ones without the rotation): the same for every row, so a program
    that takes several rows computes them once, before its loop over them. With TABLE they are read from the table
    `sign_table` wrote for this message (every position of the program's block), instead of hashed here."""
    if ROT:
        if TABLE:
            return tl.load(signs_ptr + col)
        else:
            return rot_signs(col, rkey)
    else:
        return tl.zeros(col.shape, tl.float32) + 1.0


@triton.jit(do_not_specialize=["rkey", "n"])
def sign_table(out_ptr, rkey, n, BLOCK: tl.constexpr):
    """out[i] = the rotation's sign at position i, for i < n (fp32): once per message, for every row to read."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    tl.store(out_ptr + i, rot_signs(i, rkey), mask=i < n)


@triton.jit
def any_nonfinite(y):
    """Whether fp32 y (P, N) holds a NaN or an Inf: an all-ones exponent, read off the bits (comparisons of floats
    could be folded away under assumptions of finite math)."""
    bits = y.to(tl.uint32, bitcast=True)
    return tl.max(tl.max(((bits & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def with_nan(s, bad):
    """The scalar s (fp32, bf16 or fp16), or a NaN of its dtype where `bad` (a NaN scale, as the reference's),
    chosen on the bits: compiled, a float select of a NaN constant was seen to give s (H100, Triton 3.6)."""
    if s.dtype == tl.float32:
        return tl.where(bad, 0x7FC00000, s.to(tl.uint32, bitcast=True)).to(tl.uint32).to(tl.float32, bitcast=True)
    elif s.dtype == tl.bfloat16:
        return tl.where(bad, 0x7FC0, s.to(tl.uint16, bitcast=True)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return tl.where(bad, 0x7E00, s.to(tl.uint16, bitcast=True)).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def rne(q):
    """Round fp32 |q| < 2**22 to the nearest integer, ties to even (torch.round), with IEEE adds."""
    return (q + 12582912.0) - 12582912.0


@triton.jit(do_not_specialize=["rkey", "key", "slot", "rows"])  # a key that happens to be 1 must not become a constant
def encode(x_ptr, idx_ptr, codes_ptr, scale_ptr, flag_ptr, signs_ptr, rkey, key, slot, rows, LAST: tl.constexpr,
           P: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr, ROT: tl.constexpr, STOCH: tl.constexpr,
           BUMP: tl.constexpr, INV: tl.constexpr, LOGN: tl.constexpr, FLAG: tl.constexpr, R: tl.constexpr,
           GATHER: tl.constexpr, TABLE: tl.constexpr, SUMS: tl.constexpr):
    """Codes and a scale per row of x; with GATHER, row i is x's row idx[i] (int64), as if gathered first (the noise
    follows i)."""
    col = tl.arange(0, P)[:, None] * N + tl.arange(0, N)[None, :]  # (P, N) positions in the row
    whole = tl.broadcast_to((tl.arange(0, P) < LAST // N)[:, None], (P, N))  # whole tile rows: vector accesses
    top: tl.constexpr = 2 ** (BITS - 1) - 1
    topf: tl.constexpr = 2.0 ** (BITS - 1) - 1.0
    signs = row_signs(col, rkey, signs_ptr, ROT, TABLE)  # (P, N): once for the R rows
    for r in tl.static_range(R):
        row = tl.program_id(0).to(tl.int64) * R + r
        valid = whole & (tl.zeros((P, N), tl.int64) + row < rows)  # (P, N); rows past the end: none
        src = row
        if GATHER:
            src = tl.load(idx_ptr + row, mask=row < rows, other=0)
        y = tl.load(x_ptr + src * LAST + col, mask=valid, other=0.0).to(tl.float32)  # (P, N)
        bad = any_nonfinite(y)  # of x itself, before any arithmetic
        if ROT:
            y = rotate(y, signs, INV, P, N, LOGN, SUMS)
        absmax = tl.max(tl.max(tl.abs(y), axis=1), axis=0)  # the device's max drops NaNs: `bad` looked for them
        if FLAG:  # flag = 1 where any input is NaN/Inf: the encoder's own input check
            tl.atomic_max(flag_ptr + slot, 1, mask=bad)
        scale = with_nan(cast(tl.math.div_rn(absmax, topf) * (1.0 + BUMP), scale_ptr.dtype.element_ty), bad)
        tl.store(scale_ptr + row, scale, mask=row < rows)
        s = scale.to(tl.float32)
        q = tl.math.div_rn(y, tl.where(s > 0, s, 1.0))  # (P, N)
        if STOCH:
            u = (splitmix(row * LAST + col, key) >> 40).to(tl.float32) * (2.0 ** -24)  # ops/noise.py's uniform
            q = tl.minimum(tl.maximum(tl.floor(q + u), -top), top)
        else:
            q = rne(q)
        if BITS == 8:  # two's complement bytes
            tl.store(codes_ptr + row * LAST + col, q.to(tl.int8), mask=valid)
        else:  # 8 codes -> BITS bytes of one little-endian word, first code in the lowest bits
            c = tl.reshape((q + top).to(tl.uint64), (P * N // 8, 8))  # (words, 8)
            word = tl.sum(c << (tl.arange(0, 8) * BITS).to(tl.uint64)[None, :], axis=1)  # (words,)
            j = tl.arange(0, 8)[None, :]
            byte = ((word[:, None] >> (8 * j).to(tl.uint64)) & 0xFF).to(tl.uint8)  # (words, 8)
            w = tl.arange(0, P * N // 8)[:, None]
            tl.store(codes_ptr + row * (LAST * BITS // 8) + w * BITS + j, byte,
                     mask=(j < BITS) & (w < LAST // 8) & (w * 0 + row < rows))


@triton.jit(do_not_specialize=["rkey", "slot", "rows"])
def decode(codes_ptr, scale_ptr, idx_ptr, out_ptr, flag_ptr, signs_ptr, rkey, slot, rows, LAST: tl.constexpr,
           P: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr, ROT: tl.constexpr, INV: tl.constexpr,
           LOGN: tl.constexpr, FLAG: tl.constexpr, R: tl.constexpr, SCATTER: tl.constexpr, TABLE: tl.constexpr,
           SUMS: tl.constexpr):
    """The rows of the codes and scales, in out's dtype; with SCATTER, row i goes to out's row idx[i] (int64)."""
    col = tl.arange(0, P)[:, None] * N + tl.arange(0, N)[None, :]  # (P, N)
    whole = tl.broadcast_to((tl.arange(0, P) < LAST // N)[:, None], (P, N))  # whole tile rows: vector accesses
    top: tl.constexpr = 2 ** (BITS - 1) - 1
    signs = row_signs(col, rkey, signs_ptr, ROT, TABLE)  # (P, N): once for the R rows
    for r in tl.static_range(R):
        row = tl.program_id(0).to(tl.int64) * R + r
        valid = whole & (tl.zeros((P, N), tl.int64) + row < rows)  # (P, N); rows past the end: none
        if BITS == 8:
            q = tl.load(codes_ptr + row * LAST + col, mask=valid, other=0).to(tl.float32)  # (P, N)
        else:
            j = tl.arange(0, 8)[None, :]
            w = tl.arange(0, P * N // 8)[:, None]
            byte = tl.load(codes_ptr + row * (LAST * BITS // 8) + w * BITS + j,
                           mask=(j < BITS) & (w < LAST // 8) & (w * 0 + row < rows), other=0)  # (words, 8)
            word = tl.sum(byte.to(tl.uint64) << (8 * j).to(tl.uint64), axis=1)  # (words,)
            c = (word[:, None] >> (j * BITS).to(tl.uint64)) & ((1 << BITS) - 1)  # (words, 8)
            q = tl.reshape(c.to(tl.float32), (P, N)) - top
        y = q * tl.load(scale_ptr + row, mask=row < rows, other=0.0).to(tl.float32)
        if ROT:
            y = unrotate(y, signs, INV, P, N, LOGN, SUMS)
        out = cast(y, out_ptr.dtype.element_ty)
        dst = row
        if SCATTER:
            dst = tl.load(idx_ptr + row, mask=row < rows, other=0)
        tl.store(out_ptr + dst * LAST + col, out, mask=valid)
        if FLAG:  # flag = 1 where any output is NaN/Inf (in the output's dtype): the decode's own finiteness check
            tl.atomic_max(flag_ptr + slot, 1, mask=any_nonfinite(tl.where(valid, out.to(tl.float32), 0.0)))


@triton.jit(do_not_specialize=["n", "slot"])
def screen(bits_ptr, flag_ptr, n, slot, BLOCK: tl.constexpr, EXP: tl.constexpr):
    """flag[slot] = 1 where any of the n values is NaN/Inf: all its exponent bits set (EXP, its dtype's exponent mask;
    the values read as integers of their width)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + i, mask=i < n, other=0)
    bad = tl.max(((bits & EXP) == EXP).to(tl.int32), axis=0) > 0
    tl.atomic_max(flag_ptr + slot, 1, mask=bad)


@triton.jit(do_not_specialize=["n"])
def error_sums(x_ptr, y_ptr, acc_ptr, n, BLOCK: tl.constexpr):
    """acc[0] += sum((x - y)^2), acc[1] += sum(x^2) over the n values of x and y, in fp32 per block, fp64 across."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    d = x - y
    tl.atomic_add(acc_ptr, tl.sum(d * d, axis=0).to(tl.float64))
    tl.atomic_add(acc_ptr + 1, tl.sum(x * x, axis=0).to(tl.float64))
