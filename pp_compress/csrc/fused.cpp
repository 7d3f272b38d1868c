// Fused CPU kernels for pp_compress's preset quantizers: one pass over each row (absmax, scale, rounding, packing)
// where the eager reference makes several over the whole tensor. Each kernel reproduces the reference's arithmetic
// (fp32 divisions and products, round-half-even, bf16/fp16 rounding of scales) so that the codes are bitwise the
// same; tests/unit/ops/test_fused.py holds them to that. Rows are split over torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstring>
#if defined(__BMI2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }

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

inline void unpack_row(const uint8_t* in, int64_t n, int bits, uint8_t* codes) {
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

// ops/noise.py's counter-based uniform of element i under `key`: splitmix64(key + (i + 1) * GAMMA), top 24 bits
inline float noise_uniform(uint64_t key, uint64_t i) {
  uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<uint32_t>(z >> 40)) * 0x1p-24f;
}

int64_t rows_per_task(int64_t size) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(size, 1)); }

// x as fp32 into `row`, and max |x|: the largest bit pattern without the sign bit (the order of non-negative floats),
// an integer reduction the compiler vectorizes (a float max reduction it would not, without fast-math)
template <typename scalar_t> inline float load_absmax(const scalar_t* r, int64_t size, float* row) {
  uint32_t top = 0;
  for (int64_t i = 0; i < size; ++i) {
    row[i] = to_f(r[i]);
    uint32_t b;
    std::memcpy(&b, row + i, 4);
    top = std::max(top, b & 0x7fffffffu);
  }
  float amax;
  std::memcpy(&amax, &top, 4);
  return amax;
}


}  // namespace

// Symmetric int<bits> per group: x (groups, size) contiguous -> (codes packed, scales in sdt as fp32). Rounds to
// nearest, or, given `noise_key`, stochastically: floor(x / s + u) clamped to -L..L, as the reference does, with u the
// counter-based uniform of the element's index in x (ops/noise.py: the reference's draws, computed here in place).
std::vector<torch::Tensor> sym_encode(torch::Tensor x, int64_t bits, int64_t sdt, c10::optional<int64_t> noise_key) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "sym_encode: a contiguous 2-D CPU tensor");
  const int64_t groups = x.size(0), size = x.size(1), top = (1 << (bits - 1)) - 1;
  TORCH_CHECK(size % 8 == 0 || groups <= 1, "sym_encode: rows of a multiple of 8 codes");
  auto codes = torch::empty({(groups * size * bits + 7) / 8}, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty({groups}, x.options().dtype(torch::kFloat));
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const bool stoch = noise_key.has_value();
  const uint64_t key = stoch ? static_cast<uint64_t>(*noise_key) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "sym_encode", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<float> row(size);
      std::vector<uint8_t> q(bits == 8 && !stoch ? 0 : size);
      for (int64_t g = lo; g < hi; ++g) {
        const float amax = load_absmax(xp + g * size, size, row.data());
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
            pack_row(q.data(), size, bits, out + g * size * bits / 8);
          }
        } else if (bits == 8) {
          int8_t* o = reinterpret_cast<int8_t*>(out + g * size);
          for (int64_t i = 0; i < size; ++i) o[i] = static_cast<int8_t>(static_cast<int32_t>((row[i] / safe + m) - m));
        } else {
          const float off = static_cast<float>(top);
          for (int64_t i = 0; i < size; ++i)
            q[i] = static_cast<uint8_t>(static_cast<int32_t>((row[i] / safe + m) - m + off));
          pack_row(q.data(), size, bits, out + g * size * bits / 8);
        }
      }
    });
  });
  return {codes, scales};
}

// Inverse of sym_encode: packed codes + fp32 scales (groups,) -> (groups, size) in `like`'s dtype
torch::Tensor sym_decode(torch::Tensor codes, torch::Tensor scales, int64_t bits, int64_t size, torch::Tensor like) {
  const int64_t groups = scales.size(0), top = (1 << (bits - 1)) - 1;
  auto out = torch::empty({groups, size}, like.options());
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "sym_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> q(bits == 8 ? 0 : size);
      for (int64_t g = lo; g < hi; ++g) {
        const float s = sc[g];
        scalar_t* o = op + g * size;
        if (bits == 8) {
          const int8_t* c = reinterpret_cast<const int8_t*>(in + g * size);
          for (int64_t i = 0; i < size; ++i) o[i] = static_cast<scalar_t>(static_cast<float>(c[i]) * s);
        } else {
          unpack_row(in + g * size * bits / 8, size, bits, q.data());
          const float off = static_cast<float>(top);
          for (int64_t i = 0; i < size; ++i) o[i] = static_cast<scalar_t>((static_cast<float>(q[i]) - off) * s);
        }
      }
    });
  });
  return out;
}

// Nearest normal-float level per group: x (groups, size) -> (codes packed at `bits` bits, absmax scales in sdt as
// fp32). `mid` holds the fp32 midpoints between neighbouring levels (the reference's bucketize boundaries).
std::vector<torch::Tensor> nf_encode(torch::Tensor x, torch::Tensor mid, int64_t bits, int64_t sdt) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "nf_encode: a contiguous 2-D CPU tensor");
  const int64_t groups = x.size(0), size = x.size(1), nmid = mid.size(0);
  TORCH_CHECK(size % 8 == 0 || groups <= 1, "nf_encode: rows of a multiple of 8 codes");
  auto codes = torch::empty({(groups * size * bits + 7) / 8}, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty({groups}, x.options().dtype(torch::kFloat));
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nf_encode", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<float> row(size);
      std::vector<uint8_t> q(size);
      for (int64_t g = lo; g < hi; ++g) {
        const float amax = load_absmax(xp + g * size, size, row.data());
        const float s = round_scale(amax, static_cast<int>(sdt));
        sc[g] = s;
        const float safe = s > 0.f ? s : 1.f;
        // the code is the number of midpoints < u (torch.bucketize, right=False), counted up from start[bin]
        int64_t i = 0;
#ifdef __AVX512F__
        // 16 values at a time, the two table lookups as gathers (the compiler does not emit them for this loop);
        // every operation is the scalar loop's (IEEE division, a max then a min that take a NaN to -1, truncation)
        const __m512 vs = _mm512_set1_ps(safe), one = _mm512_set1_ps(1.f), neg = _mm512_set1_ps(-1.f);
        const __m512 half_bins = _mm512_set1_ps(static_cast<float>(kBins / 2));
        const __m512i top_bin = _mm512_set1_epi32(kBins - 1), zero = _mm512_setzero_si512(), inc = _mm512_set1_epi32(1);
        for (; i + 16 <= size; i += 16) {
          const __m512 u = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(row.data() + i), vs), neg), one);
          __m512i bin = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_add_ps(u, one), half_bins));
          bin = _mm512_min_epi32(_mm512_max_epi32(bin, zero), top_bin);
          __m512i a = _mm512_i32gather_epi32(bin, start.data(), 4);
          const __m512 ma = _mm512_i32gather_ps(a, mm.data(), 4);
          a = _mm512_mask_add_epi32(a, _mm512_cmp_ps_mask(ma, u, _CMP_LT_OQ), a, inc);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + i), _mm512_cvtepi32_epi8(a));
        }
#endif
        for (; i < size; ++i) {
          const float u = std::min(1.f, std::max(-1.f, row[i] / safe));
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
torch::Tensor nf_decode(torch::Tensor codes, torch::Tensor scales, torch::Tensor levels, int64_t bits, int64_t size,
                        torch::Tensor like) {
  const int64_t groups = scales.size(0);
  auto out = torch::empty({groups, size}, like.options());
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* lv = levels.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "nf_decode", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<uint8_t> q(size);
      for (int64_t g = lo; g < hi; ++g) {
        unpack_row(in + g * size * bits / 8, size, bits, q.data());
        const float s = sc[g];
        scalar_t* o = op + g * size;
        for (int64_t i = 0; i < size; ++i) o[i] = static_cast<scalar_t>(lv[q[i]] * s);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sym_encode", &sym_encode, "symmetric int<b> per group, round to nearest or stochastically");
  m.def("sym_decode", &sym_decode, "inverse of sym_encode");
  m.def("nf_encode", &nf_encode, "nearest normal-float level per group");
  m.def("nf_decode", &nf_decode, "inverse of nf_encode");
}
