// Fused CPU kernels for pp_compress's preset quantizers: one pass over each row (absmax, scale, rounding, packing)
// where the eager reference makes several over the whole tensor. Each kernel reproduces the reference's arithmetic
// (fp32 divisions and products, round-half-even, bf16/fp16 rounding of scales) so that the codes are bitwise the
// same; tests/unit/ops/test_fused.py holds them to that. Rows are split over torch's intra-op threads.
// ATen's tensor alone, not torch/extension.h (torch's whole C++ frontend, most of the build's time)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's tensor conversions
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__BMI2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Rows between a tensor's dtype and fp32, with c10's conversions (bf16/fp16 out: round to nearest even)
template <typename T> inline void to_float_row(const T* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}
template <typename T> inline void from_float_row(const float* in, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(in[i]);
}

// round_scale: s * (1 + bump) rounded to nearest in the scale dtype (0 = fp32, 1 = bf16, 2 = fp16), as fp32 value
inline float round_scale(float s, int sdt) {
  if (sdt == 1) return static_cast<float>(c10::BFloat16(s * 1.0078125f));
  if (sdt == 2) return static_cast<float>(c10::Half(s * 1.0009765625f));
  return s;
}

// Codes of `bits` bits, first in the lowest bits of a little-endian byte stream (bits.pack_bits' layout). A row of a
// multiple of 8 codes starts on a byte boundary, so rows pack independently. The width is a template argument so
// that each 8-code word is a fixed sequence of shifts and a fixed-size store the compiler unrolls.
// With BMI2, pext/pdep move the 8 codes of a word between their bytes and their packed bits in one instruction.
template <int B> constexpr uint64_t byte_lanes() { return 0x0101010101010101ull * ((1u << B) - 1); }

template <int B> void pack_row_t(const uint8_t* codes, int64_t n, uint8_t* out) {
  int64_t i = 0, byte = 0;
  for (; i + 8 <= n; i += 8, byte += B) {
    uint64_t w = 0;
#ifdef __BMI2__
    std::memcpy(&w, codes + i, 8);
    w = _pext_u64(w, byte_lanes<B>());
#else
    for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(codes[i + j]) << (j * B);
#endif
    std::memcpy(out + byte, &w, B);
  }
  if (i < n) {
    uint64_t w = 0;
    for (int j = 0; i + j < n; ++j) w |= static_cast<uint64_t>(codes[i + j]) << (j * B);
    std::memcpy(out + byte, &w, ((n - i) * B + 7) / 8);
  }
}

template <int B> void unpack_row_t(const uint8_t* in, int64_t n, uint8_t* codes) {
  [[maybe_unused]] constexpr uint64_t mask = (1u << B) - 1;
  int64_t i = 0, byte = 0;
  for (; i + 8 <= n; i += 8, byte += B) {  // 8 codes spread into the 8 bytes of one word, stored at once
    uint64_t w = 0, r = 0;
    std::memcpy(&w, in + byte, B);
#ifdef __BMI2__
    r = _pdep_u64(w, byte_lanes<B>());
#else
    for (int j = 0; j < 8; ++j) r |= ((w >> (j * B)) & mask) << (8 * j);
#endif
    std::memcpy(codes + i, &r, 8);
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, in + byte, ((n - i) * B + 7) / 8);
    for (int j = 0; i + j < n; ++j) codes[i + j] = static_cast<uint8_t>((w >> (j * B)) & mask);
  }
}

inline void pack_row(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  switch (bits) {
    case 1: return pack_row_t<1>(codes, n, out);
    case 2: return pack_row_t<2>(codes, n, out);
    case 3: return pack_row_t<3>(codes, n, out);
    case 4: return pack_row_t<4>(codes, n, out);
    case 5: return pack_row_t<5>(codes, n, out);
    case 6: return pack_row_t<6>(codes, n, out);
    case 7: return pack_row_t<7>(codes, n, out);
    default: std::memcpy(out, codes, n);
  }
}

#ifdef __AVX512VBMI__
// 64 codes per step: a byte permute puts the B bytes holding 8 codes at the bottom of each 64-bit lane, a multishift
// moves code j's bits to the bottom of byte j, and a mask keeps B of them. A masked load and store take the tail.
inline void unpack_row_vbmi(const uint8_t* in, int64_t n, int bits, uint8_t* codes) {
  alignas(64) uint8_t perm[64], shift[64];
  for (int k = 0; k < 8; ++k)
    for (int m = 0; m < 8; ++m) {
      perm[8 * k + m] = static_cast<uint8_t>(bits * k + std::min(m, bits - 1));
      shift[8 * k + m] = static_cast<uint8_t>(bits * m);
    }
  const __m512i vperm = _mm512_load_si512(perm), vshift = _mm512_load_si512(shift);
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1u << bits) - 1));
  for (int64_t i = 0; i < n; i += 64, in += 8 * bits) {
    const int64_t left = std::min<int64_t>(64, n - i), bytes = (left * bits + 7) / 8;
    const __m512i w = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, static_cast<unsigned>(bytes)), in);
    const __m512i c = _mm512_and_si512(_mm512_multishift_epi64_epi8(vshift, _mm512_permutexvar_epi8(vperm, w)), mask);
    _mm512_mask_storeu_epi8(codes + i, _bzhi_u64(~0ull, static_cast<unsigned>(left)), c);
  }
}
#endif

inline void unpack_row(const uint8_t* in, int64_t n, int bits, uint8_t* codes) {
#if defined(__AVX512VBMI__) && defined(__BMI2__)
  if (bits < 8) return unpack_row_vbmi(in, n, bits, codes);
#endif
  if (bits < 8 && 8 % bits == 0) {  // whole codes per byte: one vectorizable loop per position in the byte
    const int per = 8 / bits;
    const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1);
    for (int j = 0; j < per; ++j)
      for (int64_t b = 0; b < n / per; ++b) codes[b * per + j] = static_cast<uint8_t>((in[b] >> (j * bits)) & mask);
    return;
  }
  switch (bits) {
    case 3: return unpack_row_t<3>(in, n, codes);
    case 5: return unpack_row_t<5>(in, n, codes);
    case 6: return unpack_row_t<6>(in, n, codes);
    case 7: return unpack_row_t<7>(in, n, codes);
    default: std::memcpy(codes, in, n);
  }
}

// ops/noise.py's counter-based stream: splitmix64(key + (i + 1) * GAMMA) for element i under `key`
inline uint64_t noise_bits(uint64_t key, uint64_t i) {
  uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// its uniform in [0, 1): the top 24 bits
inline float noise_uniform(uint64_t key, uint64_t i) {
  return static_cast<float>(static_cast<uint32_t>(noise_bits(key, i) >> 40)) * 0x1p-24f;
}

// ops/noise.py's signs: +1 where the top bit is set, else -1; fp32 (n,). One loop: the torch form is a dozen
// tensor operations, whose fixed costs dominate at a row's length (one call per message)
at::Tensor noise_signs(int64_t n, int64_t key) {
  TORCH_CHECK(n >= 0, "noise_signs: n=", n, " must be >= 0");
  auto out = at::empty({n}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) o[i] = (noise_bits(static_cast<uint64_t>(key), i) >> 63) ? 1.f : -1.f;
  return out;
}

int64_t rows_per_task(int64_t size) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(size, 1)); }

// max |x| of an fp32 row: the largest bit pattern without the sign bit (the order of non-negative floats), an integer
// reduction the compiler vectorizes (a float max reduction it would not, without fast-math)
inline float absmax(const float* row, int64_t size) {
  uint32_t top = 0;
  for (int64_t i = 0; i < size; ++i) {
    uint32_t b;
    std::memcpy(&b, row + i, 4);
    top = std::max(top, b & 0x7fffffffu);
  }
  float amax;
  std::memcpy(&amax, &top, 4);
  return amax;
}

// The row as fp32 (x itself when it is fp32, else converted into `buf`) and its max |x|
template <typename scalar_t> inline const float* load_absmax(const scalar_t* r, int64_t size, float* buf, float* amax) {
  const float* row = buf;
  if constexpr (std::is_same_v<scalar_t, float>) {
    row = r;
  } else {
    to_float_row(r, size, buf);
  }
  *amax = absmax(row, size);
  return row;
}

// Decoding is a table lookup: a row's 2**bits possible outputs (the level times the row's scale, in the output dtype,
// computed with the reference's fp32 arithmetic and rounding) are built first, then each code indexes them. With
// AVX-512 the table sits in one to four vector registers and a permute does 16 (fp32) or 32 (16-bit) lookups at once.
template <typename scalar_t> struct Lookup {
  static void row(const uint8_t* q, int64_t n, int bits, const float* tab, scalar_t* o) {
    alignas(64) scalar_t t[256] = {};
    for (int c = 0; c < (1 << bits); ++c) t[c] = static_cast<scalar_t>(tab[c]);
    int64_t i = 0;
#ifdef __AVX512BW__
    if constexpr (sizeof(scalar_t) == 2) {  // bf16, fp16: 32 lookups per permute of 16-bit entries
      if (bits <= 6) {
        const __m512i t0 = _mm512_load_si512(t), t1 = _mm512_load_si512(t + 32);
        for (; i + 32 <= n; i += 32) {
          const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)));
          _mm512_storeu_si512(o + i, bits <= 5 ? _mm512_permutexvar_epi16(idx, t0) : _mm512_permutex2var_epi16(t0, idx, t1));
        }
      }
    }
#endif
    for (; i < n; ++i) o[i] = t[q[i]];
  }
};

template <> struct Lookup<float> {
  static void row(const uint8_t* q, int64_t n, int bits, const float* tab, float* o) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (bits <= 6) {
      alignas(64) float t[64] = {};
      std::memcpy(t, tab, sizeof(float) << bits);
      const __m512 t0 = _mm512_load_ps(t), t1 = _mm512_load_ps(t + 16), t2 = _mm512_load_ps(t + 32),
                   t3 = _mm512_load_ps(t + 48);
      const __m512i b5 = _mm512_set1_epi32(32);
      for (; i + 16 <= n; i += 16) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
        __m512 v;
        if (bits <= 4) {
          v = _mm512_permutexvar_ps(idx, t0);
        } else {
          v = _mm512_permutex2var_ps(t0, idx, t1);
          if (bits == 6) v = _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, b5), v, _mm512_permutex2var_ps(t2, idx, t3));
        }
        _mm512_storeu_ps(o + i, v);
      }
    }
#endif
    for (; i < n; ++i) o[i] = tab[q[i]];
  }
};

#ifdef __AVX512F__
// u = clamp(x * (1 / s), -1, 1) for 16 values, as nf_encode's scalar loop computes it (fp32 product with the fp32
// reciprocal, a max then a min that take a NaN to -1)
inline __m512 unit16(const float* at, __m512 vinv) {
  return _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(at), vinv), _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
}

// The nearest-level codes of 16 values at a time for up to 64 levels: a branchless binary search over the midpoints
// (+inf beyond the last). The count c of midpoints < u grows by `step` where midpoint c + step - 1 is < u. Before a
// step, c is a multiple of 2 * step, so the midpoint it compares with is entry c / (2 * step) of that step's own
// table of candidates: at most 16 of them (one register, one permute), 32 for the last step of 64 levels.
struct SearchTables {
  int bits = 0;  // search steps: ceil(log2(midpoints + 1)), 0 when there are more than 63 midpoints
  float pivot = 0.f;  // the first step's midpoint
  alignas(64) float cand[6][32] = {};  // cand[j][k]: the midpoint compared at step 2**j when c = k * 2**(j + 1)
};

// Built once per call from the midpoints, padded with +inf to 64
inline SearchTables search_tables(const float* padded, int64_t nmid) {
  SearchTables t;
  t.bits = nmid < 64 ? std::max(1, static_cast<int>(std::ceil(std::log2(nmid + 1.0)))) : 0;
  if (!t.bits) return t;
  t.pivot = padded[(1 << (t.bits - 1)) - 1];
  for (int j = 0; j + 1 < t.bits; ++j)
    for (int k = 0; k < (1 << (t.bits - 1 - j)); ++k) t.cand[j][k] = padded[(k << (j + 1)) + (1 << j) - 1];
  return t;
}

// Two vectors per iteration, so that their dependency chains overlap. Returns how many values it coded.
template <int SB> int64_t nf_search_t(const float* row, int64_t size, __m512 vinv, const SearchTables& st, uint8_t* q) {
  constexpr int first = 1 << (SB - 1);
  __m512 tab[SB], last_hi = _mm512_load_ps(st.cand[0] + 16);
  for (int j = 0; j < SB; ++j) tab[j] = _mm512_load_ps(st.cand[j]);
  const __m512 pivot = _mm512_set1_ps(st.pivot);
  auto code = [&](const float* at) {
    const __m512 u = unit16(at, vinv);
    __m512i c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(pivot, u, _CMP_LT_OQ), _mm512_set1_epi32(first));
    for (int j = SB - 2; j >= 0; --j) {
      const __m512i k = _mm512_srli_epi32(c, j + 1);
      const __m512 mc = (SB == 6 && j == 0) ? _mm512_permutex2var_ps(tab[0], k, last_hi) : _mm512_permutexvar_ps(k, tab[j]);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(mc, u, _CMP_LT_OQ), c, _mm512_set1_epi32(1 << j));
    }
    return _mm512_cvtepi32_epi8(c);
  };
  int64_t i = 0;
  for (; i + 32 <= size; i += 32) {
    const __m128i a = code(row + i), b = code(row + i + 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i + 16), b);
  }
  for (; i + 16 <= size; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), code(row + i));
  return i;
}

inline int64_t nf_search(const float* row, int64_t size, __m512 vinv, const SearchTables& st, uint8_t* q) {
  switch (st.bits) {
    case 1: return nf_search_t<1>(row, size, vinv, st, q);
    case 2: return nf_search_t<2>(row, size, vinv, st, q);
    case 3: return nf_search_t<3>(row, size, vinv, st, q);
    case 4: return nf_search_t<4>(row, size, vinv, st, q);
    case 5: return nf_search_t<5>(row, size, vinv, st, q);
    default: return nf_search_t<6>(row, size, vinv, st, q);
  }
}
#endif

// One group of sym_encode from its fp32 values `row` and their max |x|: the scale (rounded to the scale dtype), the
// rounding to nearest, or stochastic with the uniform of element g * size + i under `key`, the packing. `q` holds
// size codes.
inline void encode_group(const float* row, float amax, int64_t g, int64_t size, int64_t bits, int64_t sdt, bool stoch,
                         uint64_t key, uint8_t* q, uint8_t* out, float* sc) {
  const int64_t top = (1 << (bits - 1)) - 1;
  const float s = round_scale(amax / static_cast<float>(top), static_cast<int>(sdt));
  sc[g] = s;
  // m: (v + 1.5 * 2**23) - 1.5 * 2**23 rounds |v| < 2**22 half to even, as torch.round does, and vectorizes
  // without SSE4.1's roundps; this file is built without fast-math, so the compiler keeps both operations
  const float safe = s > 0.f ? s : 1.f, m = 12582912.0f;
  if (stoch) {  // clamp(floor(q + u), -L, L): floor(q + u) may reach L + 1 through fp32 rounding of the sum
    // floor as truncation minus one below zero, on a value clamped first to [-L - 1, L]: the same integer as
    // the reference's, in operations the compiler vectorizes (std::floor it would not, without fast-math)
    const float lim = static_cast<float>(top);
    const int32_t itop = static_cast<int32_t>(top);
    const uint64_t base = static_cast<uint64_t>(g) * static_cast<uint64_t>(size);
    for (int64_t i = 0; i < size; ++i) {
      const float v = std::min(lim, std::max(-lim - 1.f, row[i] / safe + noise_uniform(key, base + i)));
      int32_t t = static_cast<int32_t>(v);
      t -= static_cast<float>(t) > v ? 1 : 0;
      q[i] = static_cast<uint8_t>(std::max(-itop, t) + itop);
    }
    if (bits == 8) {
      int8_t* o = reinterpret_cast<int8_t*>(out + g * size);
      for (int64_t i = 0; i < size; ++i) o[i] = static_cast<int8_t>(static_cast<int32_t>(q[i]) - top);
    } else {
      pack_row(q, size, bits, out + g * size * bits / 8);
    }
  } else if (bits == 8) {
    int8_t* o = reinterpret_cast<int8_t*>(out + g * size);
    for (int64_t i = 0; i < size; ++i) o[i] = static_cast<int8_t>(static_cast<int32_t>((row[i] / safe + m) - m));
  } else {
    const float off = static_cast<float>(top);
    for (int64_t i = 0; i < size; ++i) q[i] = static_cast<uint8_t>(static_cast<int32_t>((row[i] / safe + m) - m + off));
    pack_row(q, size, bits, out + g * size * bits / 8);
  }
}

// One group of sym_decode: the codes of group g times its scale s, in the output dtype. `q` holds size codes, `buf`
// size floats (16-bit outputs of int8), `tab` 128 floats.
template <typename scalar_t>
inline void decode_group(const uint8_t* in, int64_t g, int64_t size, int64_t bits, float s, uint8_t* q, float* buf,
                         float* tab, scalar_t* o) {
  if (bits == 8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(in + g * size);
    if constexpr (std::is_same_v<scalar_t, float>) {
      for (int64_t i = 0; i < size; ++i) o[i] = static_cast<float>(c[i]) * s;
    } else {
      for (int64_t i = 0; i < size; ++i) buf[i] = static_cast<float>(c[i]) * s;
      from_float_row(buf, size, o);
    }
  } else {
    unpack_row(in + g * size * bits / 8, size, bits, q);
    const float off = static_cast<float>((1 << (bits - 1)) - 1);
    for (int c = 0; c < (1 << bits); ++c) tab[c] = (static_cast<float>(c) - off) * s;
    Lookup<scalar_t>::row(q, size, static_cast<int>(bits), tab, o);
  }
}
}  // namespace

// Symmetric int<bits> per group: x (groups, size) contiguous -> (codes packed, scales in sdt as fp32). Rounds to
// nearest, or, given `noise_key`, stochastically: floor(x / s + u) clamped to -L..L, as the reference does, with u the
// counter-based uniform of the element's index in x (ops/noise.py: the reference's draws, computed here in place).
std::vector<at::Tensor> sym_encode(at::Tensor x, int64_t bits, int64_t sdt, c10::optional<int64_t> noise_key) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "sym_encode: a contiguous 2-D CPU tensor");
  const int64_t groups = x.size(0), size = x.size(1);
  TORCH_CHECK(size % 8 == 0 || groups <= 1, "sym_encode: rows of a multiple of 8 codes");
  auto codes = at::empty({(groups * size * bits + 7) / 8}, x.options().dtype(at::kByte));
  auto scales = at::empty({groups}, x.options().dtype(at::kFloat));
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const bool stoch = noise_key.has_value();
  const uint64_t key = stoch ? static_cast<uint64_t>(*noise_key) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "sym_encode", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : size);
      std::vector<uint8_t> q(size);
      for (int64_t g = lo; g < hi; ++g) {
        float amax;
        const float* row = load_absmax(xp + g * size, size, buf.data(), &amax);
        encode_group(row, amax, g, size, bits, sdt, stoch, key, q.data(), out, sc);
      }
    });
  });
  return {codes, scales};
}

// Inverse of sym_encode: packed codes + fp32 scales (groups,) -> (groups, size) in `like`'s dtype
// A decoder's codes and scales come from a peer: check that they hold what the sizes say before any is read (the
// Python side checks the message's size too; this keeps a wrong call from reading past a buffer).
static void check_decode_inputs(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t size,
                                const char* who) {
  TORCH_CHECK(bits >= 1 && bits <= 8 && size >= 1, who, ": bits in 1..8 and a positive group size");
  TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous() && codes.scalar_type() == at::kByte &&
              scales.device().is_cpu() && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
              scales.dim() == 1, who, ": contiguous CPU uint8 codes and fp32 scales (groups,)");
  const int64_t need = (scales.size(0) * size * bits + 7) / 8;
  TORCH_CHECK(codes.numel() >= need, who, ": ", codes.numel(), " bytes of codes for ", scales.size(0), " groups of ",
              size, " codes of ", bits, " bits (", need, " needed)");
}

at::Tensor sym_decode(at::Tensor codes, at::Tensor scales, int64_t bits, int64_t size, at::Tensor like) {
  check_decode_inputs(codes, scales, bits, size, "sym_decode");
  const int64_t groups = scales.size(0);
  auto out = at::empty({groups, size}, like.options());
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "sym_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> q(size);
      std::vector<float> buf(size);
      float tab[128];
      for (int64_t g = lo; g < hi; ++g) decode_group(in, g, size, bits, sc[g], q.data(), buf.data(), tab, op + g * size);
    });
  });
  return out;
}

// Nearest normal-float level per group: x (groups, size) -> (codes packed at `bits` bits, absmax scales in sdt as
// fp32). `mid` holds the fp32 midpoints between neighbouring levels (the reference's bucketize boundaries).
std::vector<at::Tensor> nf_encode(at::Tensor x, at::Tensor mid, int64_t bits, int64_t sdt) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "nf_encode: a contiguous 2-D CPU tensor");
  const int64_t groups = x.size(0), size = x.size(1), nmid = mid.size(0);
  TORCH_CHECK(size % 8 == 0 || groups <= 1, "nf_encode: rows of a multiple of 8 codes");
  auto codes = at::empty({(groups * size * bits + 7) / 8}, x.options().dtype(at::kByte));
  auto scales = at::empty({groups}, x.options().dtype(at::kFloat));
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const float* m = mid.data_ptr<float>();
  // start[b]: the midpoints below bin b's lower edge, taken half a bin lower than the edge, so rounding in the bin
  // index never starts the count past the answer. A value lies less than 1.5 bins above its start edge; midpoints
  // more than 2 bins apart (those of every nf<b> up to 8 bits) put at most one of them between, so one branchless
  // comparison finishes the count.
  constexpr int64_t kBins = 4096;
  std::vector<int32_t> start(kBins);
  std::vector<float> mm(m, m + nmid);
  mm.push_back(INFINITY);  // a sentinel: the comparison past the last midpoint is false
  for (int64_t b = 0, a = 0; b < kBins; ++b) {
    const double edge = (b - 0.5) * 2.0 / kBins - 1.0;
    while (a < nmid && m[a] < edge) ++a;
    start[b] = static_cast<int32_t>(a);
  }
  for (int64_t a = 1; a < nmid; ++a)
    TORCH_CHECK(m[a] - m[a - 1] > 2.0 * 2.0 / kBins, "nf_encode: levels closer than 2 of ", kBins,
                " bins over [-1, 1] (midpoints ", m[a - 1], " and ", m[a], "); the eager reference handles them");
#ifdef __AVX512F__
  // up to 64 levels: a binary search over the midpoints in registers; beyond, gathers
  float padded[64];
  for (int a = 0; a < 64; ++a) padded[a] = a < nmid ? m[a] : INFINITY;
  const SearchTables search = search_tables(padded, nmid);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nf_encode", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : size);
      std::vector<uint8_t> q(size);
      for (int64_t g = lo; g < hi; ++g) {
        float amax;
        const float* row = load_absmax(xp + g * size, size, buf.data(), &amax);
        const float s = round_scale(amax, static_cast<int>(sdt));
        sc[g] = s;
        const float inv = 1.f / (s > 0.f ? s : 1.f);
        // the code is the number of midpoints < u (torch.bucketize, right=False): found by the search, else (the
        // scalar tail, more than 64 levels) counted up from start[bin]
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 vinv = _mm512_set1_ps(inv), one = _mm512_set1_ps(1.f);
        if (search.bits) i = nf_search(row, size, vinv, search, q.data());
        // beyond 64 levels, the two table lookups as gathers (the compiler does not emit them for this loop)
        const __m512 half_bins = _mm512_set1_ps(static_cast<float>(kBins / 2));
        const __m512i top_bin = _mm512_set1_epi32(kBins - 1), zero = _mm512_setzero_si512(), inc = _mm512_set1_epi32(1);
        for (; i + 16 <= size; i += 16) {
          const __m512 u = unit16(row + i, vinv);
          __m512i bin = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(u, one), half_bins));
          bin = _mm512_min_epi32(_mm512_max_epi32(bin, zero), top_bin);
          __m512i a = _mm512_i32gather_epi32(bin, start.data(), 4);
          const __m512 ma = _mm512_i32gather_ps(a, mm.data(), 4);
          a = _mm512_mask_add_epi32(a, _mm512_cmp_ps_mask(ma, u, _CMP_LT_OQ), a, inc);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i), _mm512_cvtepi32_epi8(a));
        }
#endif
        for (; i < size; ++i) {
          const float u = std::min(1.f, std::max(-1.f, row[i] * inv));
          const int32_t bin = std::min<int32_t>(kBins - 1, std::max<int32_t>(0, static_cast<int32_t>((u + 1.f) * (kBins / 2))));
          const int32_t a = start[bin];
          q[i] = static_cast<uint8_t>(a + (mm[a] < u ? 1 : 0));
        }
        pack_row(q.data(), size, bits, out + g * size * bits / 8);
      }
    });
  });
  return {codes, scales};
}

// Inverse of nf_encode: level[code] * scale in `like`'s dtype
at::Tensor nf_decode(at::Tensor codes, at::Tensor scales, at::Tensor levels, int64_t bits, int64_t size,
                     at::Tensor like) {
  check_decode_inputs(codes, scales, bits, size, "nf_decode");
  TORCH_CHECK(levels.is_contiguous() && levels.scalar_type() == at::kFloat && levels.dim() == 1, "nf_decode: fp32 levels");
  const int64_t groups = scales.size(0);
  auto out = at::empty({groups, size}, like.options());
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* lv = levels.data_ptr<float>();
  const int64_t nlev = levels.size(0);
  TORCH_CHECK(nlev <= (1 << bits), "nf_decode: ", nlev, " levels do not fit ", bits, " bits");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "nf_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> q(size);
      float tab[256];
      for (int64_t g = lo; g < hi; ++g) {
        unpack_row(in + g * size * bits / 8, size, bits, q.data());
        const float s = sc[g];
        for (int c = 0; c < (1 << bits); ++c) tab[c] = c < nlev ? lv[c] * s : 0.f;  // codes stop below nlev
        Lookup<scalar_t>::row(q.data(), size, static_cast<int>(bits), tab, op + g * size);
      }
    });
  });
  return out;
}

// The orthonormal Walsh-Hadamard transform of every block of n values of x's rows (ops/hadamard.py's reference,
// bitwise): the input in fp32 times fp32 1/sqrt(n) and the signs d (unless `after`), log2(n) butterfly levels from
// the lowest bit of the position up, the signs (with `after`), the output dtype. Each
// block is worked in a buffer that stays in L1, so the tensor is read once and written once.
namespace {
#ifdef __AVX512F__
// The four levels inside a vector: each lane adds its partner (lane xor l) or, holding the b of a pair (a, b),
// subtracts itself from it. Both in one instruction: fma(v, +-1, partner) rounds v * +-1 + partner once, and
// v * +-1 is exact, so it is a + b below and a - b above, bitwise (signed zeros included)
inline __m512 levels_in_vector(__m512 v) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int l = 1; l < 16; l <<= 1) {
    const __m512 s = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(l)), v);  // the partner's value
    const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(l));
    const __m512 sign = _mm512_mask_blend_ps(upper, _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f));
    v = _mm512_fmadd_ps(v, sign, s);
  }
  return v;
}

// A whole block of N <= 256 values in N / 16 registers: every level without touching memory
template <int N> inline void butterflies_regs(float* y) {
  constexpr int V = N / 16;
  __m512 v[V];
  for (int k = 0; k < V; ++k) v[k] = levels_in_vector(_mm512_loadu_ps(y + 16 * k));
  for (int h = 1; h < V; h <<= 1)
    for (int i = 0; i < V; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const __m512 a = v[j], b = v[j + h];
        v[j] = _mm512_add_ps(a, b);
        v[j + h] = _mm512_sub_ps(a, b);
      }
  for (int k = 0; k < V; ++k) _mm512_storeu_ps(y + 16 * k, v[k]);
}
#endif

inline void butterflies(float* y, int64_t n) {
  int64_t h = 1;
#ifdef __AVX512F__
  switch (n) {
    case 16: return butterflies_regs<16>(y);
    case 32: return butterflies_regs<32>(y);
    case 64: return butterflies_regs<64>(y);
    case 128: return butterflies_regs<128>(y);
    case 256: return butterflies_regs<256>(y);
    default: break;
  }
  if (n >= 16) {
    for (int64_t k = 0; k < n; k += 16) _mm512_storeu_ps(y + k, levels_in_vector(_mm512_loadu_ps(y + k)));
    h = 16;
  }
#endif
  for (; h < n; h <<= 1)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = y[j], b = y[j + h];
        y[j] = a + b;
        y[j + h] = a - b;
      }
}

// One block of n fp32 values in place: times fp32 1/sqrt(n) (`scale`) and the signs db (unless `after`; db may be
// null), the butterfly levels, the signs (with `after`)
inline void transform_block(float* y, const float* db, int64_t n, float scale, bool after) {
  if (db && !after) {
    for (int64_t i = 0; i < n; ++i) y[i] = y[i] * scale * db[i];
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] *= scale;
  }
  butterflies(y, n);
  if (db && after)
    for (int64_t i = 0; i < n; ++i) y[i] *= db[i];
}

// int<b>:rot works in units of max(group size, n) values: whole groups and whole rotation blocks (one divides the
// other). The signs repeat every row of `last` values.
struct RotUnits {
  int64_t unit, groups, units, period;
  RotUnits(int64_t numel, int64_t last, int64_t n, int64_t size, const char* who) {
    TORCH_CHECK(n >= 2 && !(n & (n - 1)) && last % n == 0, who, ": rotation blocks of a power of two n dividing the rows");
    TORCH_CHECK(size % 8 == 0 && (size % n == 0 || n % size == 0), who, ": groups of a multiple of 8 that n divides or divide n");
    unit = std::max(size, n);
    TORCH_CHECK(numel % unit == 0, who, ": ", numel, " values are not whole units of ", unit);
    groups = numel / size;
    units = numel / unit;
    period = last / n;
  }
};

// Unit u's values as fp32 in y, rotated (fwht's arithmetic, block by block)
template <typename in_t>
inline void rotate_unit(const in_t* x, int64_t u, const RotUnits& ru, int64_t n, const float* d, float scale, float* y) {
  to_float_row(x + u * ru.unit, ru.unit, y);
  const int64_t b0 = u * ru.unit / n;  // its first block
  for (int64_t k = 0; k < ru.unit / n; ++k) transform_block(y + k * n, d + ((b0 + k) % ru.period) * n, n, scale, false);
}
}  // namespace

// int<b>:rot in one pass (bitwise fwht then sym_encode): each unit is rotated into a buffer that stays in L1, and
// its groups are encoded from there, so no fp32 copy of the tensor is written and read back. x contiguous with
// `signs` (its last dim, fp32 +-1) -> (codes packed, scales as fp32).
std::vector<at::Tensor> rot_sym_encode(at::Tensor x, at::Tensor signs, int64_t n, int64_t size, int64_t bits,
                                       int64_t sdt, c10::optional<int64_t> noise_key) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && signs.is_contiguous() && signs.scalar_type() == at::kFloat &&
              x.size(-1) == signs.numel(), "rot_sym_encode: a contiguous CPU tensor and fp32 signs of its last dim");
  const RotUnits ru(x.numel(), x.size(-1), n, size, "rot_sym_encode");
  auto codes = at::empty({(x.numel() * bits + 7) / 8}, x.options().dtype(at::kByte));
  auto scales = at::empty({ru.groups}, x.options().dtype(at::kFloat));
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const float* d = signs.data_ptr<float>();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  const bool stoch = noise_key.has_value();
  const uint64_t key = stoch ? static_cast<uint64_t>(*noise_key) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rot_sym_encode", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, ru.units, rows_per_task(ru.unit), [&](int64_t lo, int64_t hi) {
      std::vector<float> y(ru.unit);
      std::vector<uint8_t> q(size);
      for (int64_t u = lo; u < hi; ++u) {
        rotate_unit(xp, u, ru, n, d, scale, y.data());
        for (int64_t k = 0; k < ru.unit / size; ++k) {
          const float* row = y.data() + k * size;
          encode_group(row, absmax(row, size), u * (ru.unit / size) + k, size, bits, sdt, stoch, key, q.data(), out, sc);
        }
      }
    });
  });
  return {codes, scales};
}

// Inverse of rot_sym_encode (bitwise sym_decode to fp32, then fwht with the signs after): -> `like`'s dtype, x's
// numel as (units, unit); the caller reshapes
at::Tensor rot_sym_decode(at::Tensor codes, at::Tensor scales, at::Tensor signs, int64_t n, int64_t bits,
                          int64_t size, at::Tensor like) {
  TORCH_CHECK(signs.is_contiguous() && signs.scalar_type() == at::kFloat, "rot_sym_decode: fp32 signs");
  check_decode_inputs(codes, scales, bits, size, "rot_sym_decode");
  const int64_t numel = scales.size(0) * size;
  const RotUnits ru(numel, signs.numel(), n, size, "rot_sym_decode");
  auto out = at::empty({ru.units, ru.unit}, like.options());
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* d = signs.data_ptr<float>();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "rot_sym_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, ru.units, rows_per_task(ru.unit), [&](int64_t lo, int64_t hi) {
      std::vector<float> y(ru.unit);
      std::vector<uint8_t> q(size);
      float tab[128];
      for (int64_t u = lo; u < hi; ++u) {
        const int64_t g0 = u * (ru.unit / size);
        for (int64_t k = 0; k < ru.unit / size; ++k)
          decode_group<float>(in, g0 + k, size, bits, sc[g0 + k], q.data(), nullptr, tab, y.data() + k * size);
        const int64_t b0 = u * ru.unit / n;
        for (int64_t k = 0; k < ru.unit / n; ++k) transform_block(y.data() + k * n, d + ((b0 + k) % ru.period) * n, n, scale, true);
        from_float_row(y.data(), ru.unit, op + u * ru.unit);
      }
    });
  });
  return out;
}

at::Tensor fwht(at::Tensor x, c10::optional<at::Tensor> signs, int64_t n, bool after, at::Tensor like) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && x.numel() % n == 0 && n >= 2 && !(n & (n - 1)),
              "fwht: a contiguous CPU tensor in blocks of a power of two n >= 2");
  const int64_t blocks = x.numel() / n;
  const float* d = nullptr;
  int64_t period = 1;  // blocks per row: the signs repeat every row
  if (signs) {
    TORCH_CHECK(signs->is_contiguous() && signs->scalar_type() == at::kFloat && signs->numel() % n == 0 &&
                x.size(-1) == signs->numel(), "fwht: fp32 signs, one per position of the last dim");
    d = signs->data_ptr<float>();
    period = signs->numel() / n;
  }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  auto out = at::empty(x.sizes(), like.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fwht_in", [&] {
    using in_t = scalar_t;
    const in_t* xp = x.data_ptr<in_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "fwht_out", [&] {
      scalar_t* op = out.data_ptr<scalar_t>();
      at::parallel_for(0, blocks, rows_per_task(n), [&](int64_t lo, int64_t hi) {
        std::vector<float> buf(n);
        float* y = buf.data();
        for (int64_t b = lo; b < hi; ++b) {
          const in_t* xb = xp + b * n;
          const float* db = d ? d + (b % period) * n : nullptr;
          to_float_row(xb, n, y);
          transform_block(y, db, n, scale, after);
          from_float_row(y, n, op + b * n);
        }
      });
    });
  });
  return out;
}

at::Tensor vq_search(at::Tensor v, at::Tensor cb, at::Tensor cand, double lo, double inv_h, int64_t cells);  // vq.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sym_encode", &sym_encode, "symmetric int<b> per group, round to nearest or stochastically");
  m.def("sym_decode", &sym_decode, "inverse of sym_encode");
  m.def("nf_encode", &nf_encode, "nearest normal-float level per group");
  m.def("nf_decode", &nf_decode, "inverse of nf_encode");
  m.def("rot_sym_encode", &rot_sym_encode, "int<b>:rot in one pass: rotation and symmetric quantization per unit");
  m.def("rot_sym_decode", &rot_sym_decode, "inverse of rot_sym_encode");
  m.def("vq_search", &vq_search, "vq's pruned nearest-point search over a grid of candidate lists");
  m.def("noise_signs", &noise_signs, "ops/noise.py's counter-based +-1 signs of n positions under a key");
  m.def("fwht", &fwht, "orthonormal Walsh-Hadamard transform of blocks of n, with random signs before or after");
}
