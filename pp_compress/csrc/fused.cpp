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

namespace {

template <typename T> inline float to_f(T v) { return static_cast<float>(v); }

// round_scale: s * (1 + bump) rounded to nearest in the scale dtype (0 = fp32, 1 = bf16, 2 = fp16), as fp32 value
inline float round_scale(float s, int sdt) {
  if (sdt == 1) return static_cast<float>(c10::BFloat16(s * 1.0078125f));
  if (sdt == 2) return static_cast<float>(c10::Half(s * 1.0009765625f));
  return s;
}

// Codes of `bits` bits, first in the lowest bits of a little-endian byte stream (bits.pack_bits' layout). A row of a
// multiple of 8 codes starts on a byte boundary, so rows pack independently.
inline void pack_row(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  if (bits == 8) { std::memcpy(out, codes, n); return; }
  int64_t i = 0, byte = 0;
  for (; i + 8 <= n; i += 8, byte += bits) {
    uint64_t w = 0;
    for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(codes[i + j]) << (j * bits);
    std::memcpy(out + byte, &w, bits);
  }
  if (i < n) {
    uint64_t w = 0;
    for (int j = 0; i + j < n; ++j) w |= static_cast<uint64_t>(codes[i + j]) << (j * bits);
    std::memcpy(out + byte, &w, ((n - i) * bits + 7) / 8);
  }
}

inline void unpack_row(const uint8_t* in, int64_t n, int bits, uint8_t* codes) {
  if (bits == 8) { std::memcpy(codes, in, n); return; }
  if (8 % bits == 0) {  // whole codes per byte: one vectorizable loop per position in the byte
    const int per = 8 / bits;
    const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1);
    for (int j = 0; j < per; ++j)
      for (int64_t b = 0; b < n / per; ++b) codes[b * per + j] = static_cast<uint8_t>((in[b] >> (j * bits)) & mask);
    return;
  }
  const uint64_t mask = (1u << bits) - 1;
  int64_t i = 0, byte = 0;
  for (; i + 8 <= n; i += 8, byte += bits) {
    uint64_t w = 0;
    std::memcpy(&w, in + byte, bits);
    for (int j = 0; j < 8; ++j) codes[i + j] = static_cast<uint8_t>((w >> (j * bits)) & mask);
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, in + byte, ((n - i) * bits + 7) / 8);
    for (int j = 0; i + j < n; ++j) codes[i + j] = static_cast<uint8_t>((w >> (j * bits)) & mask);
  }
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
// nearest, or, given `noise` (the reference's uniform draws, same shape), stochastically: floor(x / s + u) clamped to
// -L..L, as the reference does.
std::vector<torch::Tensor> sym_encode(torch::Tensor x, int64_t bits, int64_t sdt, c10::optional<torch::Tensor> noise) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "sym_encode: a contiguous 2-D CPU tensor");
  const int64_t groups = x.size(0), size = x.size(1), top = (1 << (bits - 1)) - 1;
  TORCH_CHECK(size % 8 == 0 || groups <= 1, "sym_encode: rows of a multiple of 8 codes");
  auto codes = torch::empty({(groups * size * bits + 7) / 8}, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty({groups}, x.options().dtype(torch::kFloat));
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* sc = scales.data_ptr<float>();
  const float* un = noise.has_value() ? noise->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "sym_encode", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, groups, rows_per_task(size), [&](int64_t lo, int64_t hi) {
      std::vector<float> row(size);
      std::vector<uint8_t> q(bits == 8 && un == nullptr ? 0 : size);
      for (int64_t g = lo; g < hi; ++g) {
        const float amax = load_absmax(xp + g * size, size, row.data());
        const float s = round_scale(amax / static_cast<float>(top), static_cast<int>(sdt));
        sc[g] = s;
        // m: (v + 1.5 * 2**23) - 1.5 * 2**23 rounds |v| < 2**22 half to even, as torch.round does, and vectorizes
        // without SSE4.1's roundps; this file is built without fast-math, so the compiler keeps both operations
        const float safe = s > 0.f ? s : 1.f, m = 12582912.0f;
        if (un != nullptr) {  // floor(q + u) may reach L + 1 through fp32 rounding of the sum: clamp
          const float* u = un + g * size, lim = static_cast<float>(top);
          for (int64_t i = 0; i < size; ++i)
            q[i] = static_cast<uint8_t>(static_cast<int32_t>(
                std::min(lim, std::max(-lim, std::floor(row[i] / safe + u[i]))) + lim));
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
  // index never starts the scan past the answer; from there a value's code is a few steps up
  constexpr int64_t kBins = 4096;
  std::vector<int64_t> start(kBins);
  for (int64_t b = 0, a = 0; b < kBins; ++b) {
    const double edge = (b - 0.5) * 2.0 / kBins - 1.0;
    while (a < nmid && m[a] < edge) ++a;
    start[b] = a;
  }
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
        for (int64_t i = 0; i < size; ++i) {
          const float u = std::min(1.f, std::max(-1.f, row[i] / safe));
          const int64_t bin = std::min<int64_t>(kBins - 1, std::max<int64_t>(0, static_cast<int64_t>((u + 1.f) * (kBins / 2))));
          int64_t a = start[bin];  // the number of midpoints < u (torch.bucketize, right=False), from below
          while (a < nmid && m[a] < u) ++a;
          q[i] = static_cast<uint8_t>(a);
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
  m.def("sym_encode", &sym_encode, "symmetric int<b> per group, round to nearest");
  m.def("sym_decode", &sym_decode, "inverse of sym_encode");
  m.def("nf_encode", &nf_encode, "nearest normal-float level per group");
  m.def("nf_decode", &nf_decode, "inverse of nf_encode");
}
