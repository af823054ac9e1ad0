// Linear layers over GGUF weight blocks as stored (Q4_1, Q8_0): y = x @ W.T, where W is
// never materialised in float32. Each block of 32 weights is dequantized in registers
// exactly as gguf-py does it (d * q + m for Q4_1, d * q for Q8_0: a product and a sum, each
// rounded to float32, never fused) and accumulated with fused multiply-adds in float32.
//
// Invariants:
// - Output (r, o) is the dot product of input row r with dequantized weight row o, summed in
//   one fixed order (eight lanes over the blocks in turn, then the lanes pairwise), whatever
//   the number of rows, the threads or the row's place in the batch: a row's result does not
//   depend on the batch it is in.
// - AVX2 + FMA + F16C code runs only where the CPU has them (checked at run time); elsewhere
//   a scalar loop with the same summation order runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "sample_ops.h"
#include "step_ops.h"

namespace {

constexpr int64_t kBlock = 32;
// Each stream of blocks a tile reads asks for the bytes this far ahead of it: a weight row is
// a few hundred bytes, too short a stream for the CPU's own prefetchers, and the weights of a
// decode step come from memory, not cache.
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kQ4_1Bytes = 20;  // half d, half m, 16 bytes of nibbles
constexpr int64_t kQ8_0Bytes = 34;  // half d, 32 signed bytes

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int shift = 0;
      while (!(mantissa & 0x400)) {
        mantissa <<= 1;
        ++shift;
      }
      mantissa &= 0x3ff;
      bits = sign | static_cast<uint32_t>(127 - 15 - shift + 1) << 23 | mantissa << 13;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

uint16_t read_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return h;
}

// One block's 32 weights, as gguf-py dequantizes them.
void dequantize_scalar(bool q4_1, const uint8_t* block, float* w) {
  const float d = half_to_float(read_half(block));
  if (q4_1) {
    const float m = half_to_float(read_half(block + 2));
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
      volatile float lo = d * static_cast<float>(qs[j] & 0x0f);  // rounded before the sum
      volatile float hi = d * static_cast<float>(qs[j] >> 4);
      w[j] = lo + m;
      w[j + 16] = hi + m;
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(qs[j]) * d;
  }
}

// A hint: it never faults, past the blocks' end included.
inline void prefetch(const uint8_t* block) {
  __builtin_prefetch(block + kPrefetchBytes, 0, 3);
}

// Scalar path: eight lanes as the vector path keeps them, then summed pairwise the same way
// (step_ops::lanes_sum).
using step_ops::lanes_sum;

void rows_scalar(bool q4_1, const uint8_t* wrow, int64_t blocks, const float* x, int64_t in,
                 int64_t rows, float* out, int64_t out_stride) {
  const int64_t bytes = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  float w[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float* xr = x + r * in;
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_scalar(q4_1, wrow + b * bytes, w);
      for (int v = 0; v < 4; ++v)
        for (int l = 0; l < 8; ++l)
          lane[l] = std::fma(w[v * 8 + l], xr[b * kBlock + v * 8 + l], lane[l]);
    }
    out[r * out_stride] = lanes_sum(lane);
  }
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum(__m256 v) {
  // lanes (0+4, 1+5, 2+6, 3+7), then (a + c) + (b + e) as lanes_sum
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (a + c, b + e)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

__attribute__((target("avx2,fma,f16c"))) inline void dequantize_avx2(bool q4_1,
                                                                     const uint8_t* block,
                                                                     __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(read_half(block)));
  if (q4_1) {
    const __m256 m = _mm256_set1_ps(_cvtsh_ss(read_half(block + 2)));
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);                     // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // weights 16..31
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int v = 0; v < 4; ++v) {
      const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[v]));
      w[v] = _mm256_add_ps(_mm256_mul_ps(d, q), m);
    }
  } else {
    for (int v = 0; v < 4; ++v) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * v));
      w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
    }
  }
}

// Output rows [o0, o0 + O) against input rows [r0, r0 + R): one accumulator per pair, so
// O * R independent chains of fused multiply-adds; each chain sums its blocks in order.
template <int O, int R>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(bool q4_1, const uint8_t* wp,
                                                        int64_t blocks, const float* x,
                                                        int64_t in, int64_t o0, int64_t r0,
                                                        float* out, int64_t out_stride) {
  const int64_t bytes = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  __m256 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  alignas(32) float w[O][kBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int o = 0; o < O; ++o) {
      __m256 v[4];
      const uint8_t* block = wp + ((o0 + o) * blocks + b) * bytes;
      prefetch(block);
      dequantize_avx2(q4_1, block, v);
      for (int j = 0; j < 4; ++j) _mm256_store_ps(w[o] + 8 * j, v[j]);
    }
    for (int j = 0; j < 4; ++j) {
      __m256 xs[R];
      for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x + (r0 + r) * in + b * kBlock + 8 * j);
      for (int o = 0; o < O; ++o) {
        const __m256 wv = _mm256_load_ps(w[o] + 8 * j);
        for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(wv, xs[r], acc[o][r]);
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[(r0 + r) * out_stride + o0 + o] = hsum(acc[o][r]);
}

// Output rows [begin, end) for every input row, in tiles.
__attribute__((target("avx2,fma,f16c"))) void outputs_avx2(bool q4_1, const uint8_t* wp,
                                                           int64_t blocks, const float* x,
                                                           int64_t in, int64_t rows,
                                                           int64_t begin, int64_t end,
                                                           float* out, int64_t out_stride) {
  int64_t o = begin;
  if (rows == 1) {
    for (; o + 8 <= end; o += 8) tile_avx2<8, 1>(q4_1, wp, blocks, x, in, o, 0, out, out_stride);
  } else {
    for (; o + 4 <= end; o += 4) {
      int64_t r = 0;
      for (; r + 2 <= rows; r += 2)
        tile_avx2<4, 2>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
      if (r < rows) tile_avx2<4, 1>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    }
  }
  for (; o < end; ++o)
    for (int64_t r = 0; r < rows; ++r)
      tile_avx2<1, 1>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
}

// The AVX-512 kernels: a block is two 16-lane vectors. A Q4_1 block's 16 possible weights
// (d * q + m for q = 0..15, each rounded as gguf-py rounds it) are computed once and its
// nibbles pick from them with one permute per 16 weights: byte j of the block's 16 (weight
// j in its low nibble, weight j + 16 in its high one) widened to lane j indexes the first
// 16 as it is (a permute reads only an index's low 4 bits) and, shifted right by 4, the rest.
// The block's d and m (as floats, converted exactly from their halves) come from the tile's
// scales (scales_avx512): a half's conversion a block at a time costs the shuffle port as
// much as the weights' own permutes do.
__attribute__((target("avx512f,f16c"))) inline void dequantize_avx512(bool q4_1,
                                                                      const uint8_t* block,
                                                                      const float* d_scale,
                                                                      const float* m_scale,
                                                                      __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(*d_scale);
  if (q4_1) {
    const __m512 m = _mm512_set1_ps(*m_scale);
    const __m512 table = _mm512_add_ps(
        _mm512_mul_ps(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), m);
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    for (int v = 0; v < 2; ++v) {
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * v));
      w[v] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), d);
    }
  }
}

// Output rows [o0, o0 + O)'s scales of blocks [b0, b0 + n), n <= 16: d (a block's first
// half) into d[o][j], and for Q4_1 m (its second) into m[o][j], 16 blocks' halves gathered
// and converted at once.
template <int O>
__attribute__((target("avx512f,f16c"))) inline void scales_avx512(
    bool q4_1, const uint8_t* wp, int64_t blocks, int64_t o0, int64_t b0, int n,
    float (*d)[16], float (*m)[16]) {
  const int64_t bytes = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  const __m512i offsets = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(bytes)));
  const __mmask16 lanes = static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1);
  for (int o = 0; o < O; ++o) {
    const uint8_t* first = wp + ((o0 + o) * blocks + b0) * bytes;
    // each block's first four bytes (d and m; d and two weights for Q8_0), only the n blocks'
    const __m512i halves = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, offsets,
                                                       first, 1);
    _mm512_store_ps(d[o], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves)));
    if (q4_1)
      _mm512_store_ps(m[o], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(halves, 16))));
  }
}

__attribute__((target("avx512f"))) inline float hsum512(__m512 v) {
  // (lanes i + i+8), then the eight as hsum does
  const __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 t = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <int O, int R>
__attribute__((target("avx512f,f16c"))) void tile_avx512(bool q4_1, const uint8_t* wp,
                                                         int64_t blocks, const float* x,
                                                         int64_t in, int64_t o0, int64_t r0,
                                                         float* out, int64_t out_stride) {
  const int64_t bytes = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  __m512 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  alignas(64) float d[O][16], m[O][16];
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, blocks - b0));
    scales_avx512<O>(q4_1, wp, blocks, o0, b0, n, d, m);
    for (int j = 0; j < n; ++j) {
      const int64_t b = b0 + j;
      __m512 w[O][2];
      for (int o = 0; o < O; ++o) {
        const uint8_t* block = wp + ((o0 + o) * blocks + b) * bytes;
        prefetch(block);
        dequantize_avx512(q4_1, block, &d[o][j], &m[o][j], w[o]);
      }
      for (int r = 0; r < R; ++r) {
        const float* xb = x + (r0 + r) * in + b * kBlock;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        for (int o = 0; o < O; ++o) {
          acc[o][r] = _mm512_fmadd_ps(w[o][0], x0, acc[o][r]);
          acc[o][r] = _mm512_fmadd_ps(w[o][1], x1, acc[o][r]);
        }
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[(r0 + r) * out_stride + o0 + o] = hsum512(acc[o][r]);
}

// Output rows [begin, end) for every input row: tiles of 4 outputs by up to 4 rows, or
// past 4 rows of 2 outputs by up to 8 (a block dequantized once for more rows).
template <int O>
__attribute__((target("avx512f,f16c"))) void tiles_avx512(bool q4_1, const uint8_t* wp,
                                                           int64_t blocks, const float* x,
                                                           int64_t in, int64_t o, int64_t r,
                                                           int64_t n, float* out,
                                                           int64_t out_stride) {
  switch (n) {
    case 1: return tile_avx512<O, 1>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    case 2: return tile_avx512<O, 2>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    case 3: return tile_avx512<O, 3>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    case 4: return tile_avx512<O, 4>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    case 5: return tile_avx512<O, 5>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    case 6: return tile_avx512<O, 6>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    case 7: return tile_avx512<O, 7>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
    default: return tile_avx512<O, 8>(q4_1, wp, blocks, x, in, o, r, out, out_stride);
  }
}

__attribute__((target("avx512f,f16c"))) void outputs_avx512(bool q4_1, const uint8_t* wp,
                                                             int64_t blocks, const float* x,
                                                             int64_t in, int64_t rows,
                                                             int64_t begin, int64_t end,
                                                             float* out, int64_t out_stride) {
  const int64_t per_pass = rows <= 4 ? 4 : 8;
  int64_t o = begin;
  for (; o + 2 <= end; o += rows <= 4 ? 4 : 2) {
    if (rows <= 4 && o + 4 > end) break;
    for (int64_t r = 0; r < rows; r += per_pass) {
      const int64_t n = std::min(per_pass, rows - r);
      if (rows <= 4)
        tiles_avx512<4>(q4_1, wp, blocks, x, in, o, r, n, out, out_stride);
      else
        tiles_avx512<2>(q4_1, wp, blocks, x, in, o, r, n, out, out_stride);
    }
  }
  for (; o < end; ++o)
    for (int64_t r = 0; r < rows; r += 8)
      tiles_avx512<1>(q4_1, wp, blocks, x, in, o, r, std::min<int64_t>(8, rows - r), out,
                      out_stride);
}

bool has_avx512() {
  static const bool found = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c");
  return found;
}

bool has_avx2() {
  static const bool found = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                            __builtin_cpu_supports("f16c");
  return found;
}

// The instruction sets a product can run with, best last.
enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

int64_t best_isa() { return has_avx512() ? kAvx512 : has_avx2() ? kAvx2 : kScalar; }

at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t in_features,
                  bool q4_1, int64_t isa) {
  TORCH_CHECK(isa >= kScalar && isa <= best_isa(),
              "gguf linear: instruction set ", isa, " is not available on this CPU");
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "gguf linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gguf linear: float32 inputs only");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "gguf linear: blocks must be uint8 [out_features, bytes per row]");
  TORCH_CHECK(in_features % kBlock == 0, "gguf linear: in_features must be a multiple of 32");
  TORCH_CHECK(x.size(-1) == in_features, "gguf linear: x's last dimension is not in_features");
  const int64_t blocks_per_row = in_features / kBlock;
  const int64_t bytes = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(blocks.size(1) == blocks_per_row * bytes && blocks.is_contiguous(),
              "gguf linear: blocks do not hold in_features weights per row");
  const int64_t out_features = blocks.size(0);
  const at::Tensor flat = x.reshape({-1, in_features}).contiguous();
  const int64_t rows = flat.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = out_features;
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const float* xp = flat.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const bool wide = isa == kAvx512;
  const bool vector = isa == kAvx2;
  // about 64k multiply-adds per task, so that small layers are not split to nothing
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, in_features * rows));
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    if (wide) {
      outputs_avx512(q4_1, wp, blocks_per_row, xp, in_features, rows, begin, end, op,
                     out_features);
      return;
    }
    if (vector) {
      outputs_avx2(q4_1, wp, blocks_per_row, xp, in_features, rows, begin, end, op,
                   out_features);
      return;
    }
    for (int64_t o = begin; o < end; ++o)
      rows_scalar(q4_1, wp + o * blocks_per_row * bytes, blocks_per_row, xp, in_features,
                  rows, op + o, out_features);
  });
  return out.reshape(sizes);
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t in_features) {
  return linear(x, blocks, in_features, true, best_isa());
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t in_features) {
  return linear(x, blocks, in_features, false, best_isa());
}

// A product with a given instruction set (Isa; the tests check each one the CPU has).
at::Tensor linear_with(const at::Tensor& x, const at::Tensor& blocks, int64_t in_features,
                       bool q4_1, int64_t isa) {
  return linear(x, blocks, in_features, q4_1, isa);
}

// The weights themselves, [out_features, in_features] float32 (for tests and large batches).
at::Tensor dequantize(const at::Tensor& blocks, int64_t in_features, bool q4_1) {
  const int64_t blocks_per_row = in_features / kBlock;
  const int64_t bytes = q4_1 ? kQ4_1Bytes : kQ8_0Bytes;
  TORCH_CHECK(blocks.size(1) == blocks_per_row * bytes && blocks.is_contiguous(),
              "gguf dequantize: blocks do not hold in_features weights per row");
  at::Tensor out = at::empty({blocks.size(0), in_features}, at::kFloat);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, blocks.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o)
      for (int64_t b = 0; b < blocks_per_row; ++b)
        dequantize_scalar(q4_1, wp + (o * blocks_per_row + b) * bytes,
                          op + o * in_features + b * kBlock);
  });
  return out;
}

at::Tensor dequantize_q4_1(const at::Tensor& blocks, int64_t in_features) {
  return dequantize(blocks, in_features, true);
}

at::Tensor dequantize_q8_0(const at::Tensor& blocks, int64_t in_features) {
  return dequantize(blocks, in_features, false);
}

// ---- a Llama-family step in one call (the steps decode_step.py hands here) -----------------
// Over float32 weights, llama_step_dense makes the Python lean forward's ATen calls
// (batchspec/runtime/forward.py) in its order: the same results bit for bit (tested), without a
// Python call per operation. Over GGUF blocks, llama_step does the work beside its products in
// step_ops' loops instead.

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  const at::Tensor variance = hidden.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (hidden * at::rsqrt(variance + eps));
}

at::Tensor rotated(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor turned = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return (x * cos) + (turned * sin);
}

// How a layer attends (as transformers' SDPA function and attention.grouped_sdpa call SDPA):
// kDirect: SDPA over q as it is (with `mask` where defined, enable_gqa as `gqa`); kPacked: one
// query per row, its heads packed [batch, kv_heads, groups, head_dim] under `mask`; kFolded:
// each key/value head's query heads folded into its query axis under `mask`, given repeated
// for the groups.
enum Attend : int64_t { kDirect = 0, kPacked = 1, kFolded = 2 };

// What every layer of a step shares: the new positions' rotations, the layers' key/value
// buffers [batch, kv_heads, capacity, head_dim] (written up to column written[l], where the
// new positions go) and how they attend.
struct Step {
  const at::Tensor& cos;
  const at::Tensor& sin;
  at::TensorList keys;
  at::TensorList values;
  at::IntArrayRef written;
  const c10::optional<at::Tensor>& mask;
  int64_t attend, heads, kv_heads, head_dim;
  double eps, scaling;
  bool gqa;
};

// Layer l's attention over its cache and the new positions: q [batch, fed, heads, head_dim]
// and k [batch, fed, kv_heads, head_dim] rotated, v as k; their keys and values written into
// the layer's buffers first. Returns [batch, fed, heads * head_dim], contiguous.
at::Tensor attended(const Step& s, int64_t l, const at::Tensor& q_rows, const at::Tensor& k,
                    const at::Tensor& v) {
  const int64_t batch = q_rows.size(0), fed = q_rows.size(1);
  const int64_t groups = s.heads / s.kv_heads, column = s.written[l];
  TORCH_CHECK(column + fed <= s.keys[l].size(2), "llama_step: no free columns in layer ", l);
  s.keys[l].slice(2, column, column + fed).copy_(k.transpose(1, 2));
  s.values[l].slice(2, column, column + fed).copy_(v.transpose(1, 2));
  const at::Tensor key = s.keys[l].slice(2, 0, column + fed);
  const at::Tensor value = s.values[l].slice(2, 0, column + fed);
  const at::Tensor q = q_rows.transpose(1, 2);
  at::Tensor out;
  if (s.attend == kPacked) {
    out = at::scaled_dot_product_attention(q.reshape({batch, s.kv_heads, groups, s.head_dim}),
                                           key, value, s.mask, 0.0, false, s.scaling)
              .reshape({batch, -1, 1, s.head_dim});
  } else if (s.attend == kFolded) {
    out = at::scaled_dot_product_attention(
              q.reshape({batch, s.kv_heads, groups * fed, s.head_dim}), key, value, s.mask, 0.0,
              false, s.scaling)
              .reshape({batch, s.heads, fed, s.head_dim});
  } else {
    out = at::scaled_dot_product_attention(q, key, value, s.mask, 0.0, false, s.scaling, s.gqa);
  }
  return out.transpose(1, 2).contiguous().reshape({batch, fed, -1});
}

void check_step(const at::Tensor& hidden, const Step& s, size_t weights, size_t kinds,
                int64_t per_layer, int64_t kinds_per_layer) {
  const int64_t layers = static_cast<int64_t>(s.keys.size());
  TORCH_CHECK(static_cast<int64_t>(weights) == per_layer * layers &&
                  static_cast<int64_t>(kinds) == kinds_per_layer * layers &&
                  static_cast<int64_t>(s.values.size()) == layers &&
                  static_cast<int64_t>(s.written.size()) == layers,
              "llama_step: ", per_layer, " weights, ", kinds_per_layer,
              " kinds, keys, values and a column per layer");
  TORCH_CHECK(hidden.dim() == 3, "llama_step: hidden is [batch, new positions, width]");
  TORCH_CHECK(s.attend == kDirect || s.mask.has_value(), "llama_step: this attention needs a mask");
  TORCH_CHECK(s.attend != kPacked || hidden.size(1) == 1,
              "llama_step: packed heads take one query a row");
}

// x [rows, in] @ weight.T for a float32 weight [out, in] into columns [offset, offset + out)
// of out [rows, columns] (step_ops::dense_rows: a row's result whatever the batch).
void dense_into(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, int64_t offset) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  offset + weight.size(0) <= out.size(1),
              "llama_step: float32 weights [out, in], contiguous, that fit their output");
  const int64_t rows = x.size(0), in = x.size(1), columns = out.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>() + offset;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, in * rows));
  at::parallel_for(0, weight.size(0), grain, [&](int64_t begin, int64_t end) {
    step_ops::dense_rows(xp, rows, in, wp, begin, end, op, columns);
  });
}

// A layer's products in llama_step: over GGUF blocks (6 weights a layer, 4 kinds) or over
// float32 weights (9 weights a layer, no kinds), each product's weights joined in its output.
struct Products {
  at::TensorList weights;
  at::IntArrayRef kinds;
  int64_t isa;

  bool dense() const { return kinds.empty(); }
  int64_t per_layer() const { return dense() ? 9 : 6; }
  const at::Tensor& input_norm(int64_t l) const { return weights[per_layer() * l]; }
  const at::Tensor& post_norm(int64_t l) const { return weights[per_layer() * l + (dense() ? 5 : 3)]; }

  // product p of layer l (0: q/k/v, 1: o, 2: gate/up, 3: down) of x [rows, in]
  at::Tensor operator()(int64_t l, int64_t p, const at::Tensor& x) const {
    if (!dense()) {
      return linear(x, weights[6 * l + 1 + (p < 2 ? p : p + 1)], x.size(1), kinds[4 * l + p] == 1,
                    isa);
    }
    static constexpr int64_t kFirst[4] = {1, 4, 6, 8}, kCount[4] = {3, 1, 2, 1};
    const at::Tensor* w = weights.data() + 9 * l + kFirst[p];
    int64_t columns = 0;
    for (int64_t i = 0; i < kCount[p]; ++i) columns += w[i].size(0);
    at::Tensor out = at::empty({x.size(0), columns}, x.options());
    for (int64_t i = 0, offset = 0; i < kCount[p]; offset += w[i].size(0), ++i)
      dense_into(x, w[i], out, offset);
    return out;
  }
};

// hidden [batch, new, width] -> hidden after every layer (before the final norm), every row's
// work in step_ops' loops (a position's result independent of the step it is in): every query
// attends where `mask` says, or causally without one. Per layer l over GGUF blocks:
// weights[6l .. 6l+5] = input norm, joined q/k/v blocks, o blocks, post-attention norm,
// joined gate/up blocks, down blocks; kinds[4l .. 4l+3] their block kinds (1: Q4_1, 0: Q8_0).
// Over float32 weights (kinds empty): weights[9l .. 9l+8] = input norm, q, k, v, o,
// post-attention norm, gate, up, down.
at::Tensor llama_step(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                      at::TensorList weights, at::IntArrayRef kinds, at::TensorList keys,
                      at::TensorList values, at::IntArrayRef written,
                      const c10::optional<at::Tensor>& mask, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, double eps, double scaling) {
  const Step s{cos, sin, keys, values, written, mask, kDirect, heads, kv_heads, head_dim,
               eps, scaling, false};
  const Products product{weights, kinds, best_isa()};
  check_step(hidden_in, s, weights.size(), kinds.size(), product.per_layer(),
             product.dense() ? 0 : 4);
  const int64_t batch = hidden_in.size(0), fed = hidden_in.size(1), width = hidden_in.size(2);
  const int64_t rows = batch * fed, inner_width = heads * head_dim;
  TORCH_CHECK(hidden_in.scalar_type() == at::kFloat && kv_heads > 0 && heads % kv_heads == 0 &&
                  head_dim % 2 == 0 && head_dim <= step_ops::kMaxHeadDim,
              "llama_step: float32 hidden states; heads grouped over the key/value heads; an "
              "even head_dim of at most ", step_ops::kMaxHeadDim);
  TORCH_CHECK(cos.numel() == rows * head_dim && sin.numel() == rows * head_dim,
              "llama_step: cos and sin hold head_dim values per position fed");
  TORCH_CHECK(!mask.has_value() || (mask->scalar_type() == at::kBool && mask->dim() == 4 &&
                                    mask->size(0) == batch && mask->size(2) == fed),
              "llama_step: the mask is bool [batch, 1, fed, columns]");
  const at::Tensor cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  at::Tensor hidden = hidden_in.reshape({rows, width}).clone();  // summed into in place
  at::Tensor normed = at::empty({rows, width}, hidden.options());
  at::Tensor attended_rows = at::empty({rows, inner_width}, hidden.options());
  float* h = hidden.data_ptr<float>();
  for (int64_t l = 0; l < static_cast<int64_t>(keys.size()); ++l) {
    const int64_t column = written[l];
    TORCH_CHECK(keys[l].scalar_type() == at::kFloat && keys[l].dim() == 4 &&
                    keys[l].stride(3) == 1 && keys[l].strides() == values[l].strides() &&
                    keys[l].size(0) == batch && keys[l].size(1) == kv_heads &&
                    keys[l].size(3) == head_dim && column + fed <= keys[l].size(2),
                "llama_step: layer ", l, "'s keys and values are float32 [batch, kv_heads, "
                "columns, head_dim] alike, with free columns");
    TORCH_CHECK(!mask.has_value() || mask->size(3) == column + fed,
                "llama_step: the mask covers every column of layer ", l);
    step_ops::rms_norm(h, product.input_norm(l).data_ptr<float>(), rows, width,
                       static_cast<float>(eps), normed.data_ptr<float>());
    at::Tensor qkv = product(l, 0, normed);
    step_ops::rotate(qkv.data_ptr<float>(), rows, heads + kv_heads, qkv.size(1), head_dim,
                     cos_rows.data_ptr<float>(), sin_rows.data_ptr<float>());
    const step_ops::Cache cache{keys[l].data_ptr<float>(), values[l].data_ptr<float>(),
                                {keys[l].stride(0), keys[l].stride(1), keys[l].stride(2)}};
    step_ops::attention(qkv.data_ptr<float>(), batch, fed, heads, kv_heads, head_dim, cache,
                        column, mask, static_cast<float>(scaling),
                        attended_rows.data_ptr<float>());
    step_ops::add_into(h, product(l, 1, attended_rows).data_ptr<float>(), rows * width);
    step_ops::rms_norm(h, product.post_norm(l).data_ptr<float>(), rows, width,
                       static_cast<float>(eps), normed.data_ptr<float>());
    const at::Tensor gate_up = product(l, 2, normed);
    const int64_t inner = gate_up.size(1) / 2;
    at::Tensor inputs = at::empty({rows, inner}, hidden.options());
    step_ops::silu_gate(gate_up.data_ptr<float>(), rows, inner, inputs.data_ptr<float>());
    step_ops::add_into(h, product(l, 3, inputs).data_ptr<float>(), rows * width);
  }
  return hidden.view({batch, fed, width});
}

// x [rows, in] @ W.T: W a float32 weight [out, in] (kind -1) or GGUF blocks of `kind`
// (1: Q4_1, 0: Q8_0) [out, bytes a row].
at::Tensor product_of(const at::Tensor& x, const at::Tensor& weight, int64_t kind, int64_t isa) {
  if (kind >= 0) return linear(x, weight, x.size(1), kind == 1, isa);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  dense_into(x, weight, out, 0);
  return out;
}

// A draft's greedy proposal: `steps` steps of every row in one call, the first feeding
// tokens [batch, fed] (long) at positions [batch] (long, the first's) on, each after it the
// token the one before chose. embed [vocab, width]: the input embeddings; a feature head's
// fuse weight (product_of's, of `fuse_kind`) and features [batch, fed, width], the features
// before the tokens fed first: a step's input is then fuse(embedding, features), and its
// own final hidden states the next step's features. cos/sin [positions, head_dim]: the
// rotations of every position. The layers as llama_step takes them, their buffers written up
// to written[l] with room for fed + steps - 1 more columns; column_mask [batch, columns]
// (bool) the real columns written so far (none: all). The final norm and the head
// (product_of's, of `head_kind`, vocab' rows), head_ids [vocab'] the token of each head row
// (none: row i is token i). Each step's choice is, from its last position's logits, a greedy
// row's first largest logit and a sampled row's seeded Gumbel-max choice
// (sample_ops::choose_one) under its settings, `sampling` = (temperature [batch] float32, 0
// for a greedy row; top_k [batch] long; top_p [batch] float32; seed [batch] long; none: every
// row greedy) with the noise of the position the chosen token takes; its confidence the
// largest logit's probability. With min_confidence > 0 the loop stops
// after the step at which every row's product of confidences, from `sure` [batch] on, is
// below it. Returns (tokens [batch, steps run], confidences [batch, steps run]).
std::tuple<at::Tensor, at::Tensor> llama_draft(
    const at::Tensor& tokens_in, const at::Tensor& positions, const at::Tensor& embed,
    const c10::optional<at::Tensor>& fuse, int64_t fuse_kind,
    const c10::optional<at::Tensor>& features, const at::Tensor& cos_table,
    const at::Tensor& sin_table, at::TensorList weights, at::IntArrayRef kinds,
    at::TensorList keys, at::TensorList values, at::IntArrayRef written,
    const c10::optional<at::Tensor>& column_mask, const at::Tensor& norm, const at::Tensor& head,
    int64_t head_kind, const c10::optional<at::Tensor>& head_ids, at::TensorList sampling,
    int64_t steps, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scaling,
    double norm_eps, const at::Tensor& sure_in, double min_confidence) {
  TORCH_CHECK(tokens_in.dim() == 2 && tokens_in.size(1) >= 1 && steps >= 1,
              "llama_draft: tokens [batch, fed]; at least one step");
  const int64_t batch = tokens_in.size(0), first_fed = tokens_in.size(1);
  const int64_t width = embed.size(1), vocab = head.size(0);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == batch && sure_in.dim() == 1 &&
                  sure_in.size(0) == batch,
              "llama_draft: a position and a confidence a row");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && norm.scalar_type() == at::kFloat &&
                  norm.numel() == width && cos_table.size(1) == head_dim &&
                  (head_kind >= 0 || (head.scalar_type() == at::kFloat && head.size(1) == width)),
              "llama_draft: float32 embeddings and final norm of the model's width; a head "
              "over that width");
  TORCH_CHECK(fuse.has_value() == features.has_value() &&
                  (!features.has_value() ||
                   (features->scalar_type() == at::kFloat && features->dim() == 3 &&
                    features->size(0) == batch && features->size(1) == first_fed &&
                    features->size(2) == width)),
              "llama_draft: a fuse weight with float32 features [batch, fed, width], or neither");
  TORCH_CHECK(!head_ids.has_value() || (head_ids->numel() == vocab &&
                                        head_ids->scalar_type() == at::kLong),
              "llama_draft: a token (long) per head row");
  TORCH_CHECK(sampling.empty() ||
                  (sampling.size() == 4 && sampling[0].scalar_type() == at::kFloat &&
                   sampling[1].scalar_type() == at::kLong &&
                   sampling[2].scalar_type() == at::kFloat &&
                   sampling[3].scalar_type() == at::kLong &&
                   std::all_of(sampling.begin(), sampling.end(), [&](const at::Tensor& t) {
                     return t.dim() == 1 && t.size(0) == batch && t.is_contiguous();
                   })),
              "llama_draft: sampling is temperature, top_k, top_p and seed, one a row");
  const float* temperature = sampling.empty() ? nullptr : sampling[0].data_ptr<float>();
  const at::Tensor first_positions = positions.to(at::kLong).contiguous();
  const int64_t new_columns = first_fed + steps - 1;
  TORCH_CHECK(positions.min().item<int64_t>() >= 0 &&
                  positions.max().item<int64_t>() + new_columns <= cos_table.size(0),
              "llama_draft: positions past the rotation table");
  at::Tensor mask_columns;  // [batch, columns + new]: the real columns, then the new ones
  int64_t old_columns = 0;
  if (column_mask.has_value()) {
    TORCH_CHECK(column_mask->scalar_type() == at::kBool && column_mask->dim() == 2 &&
                    column_mask->size(0) == batch,
                "llama_draft: the column mask is bool [batch, columns]");
    old_columns = column_mask->size(1);
    mask_columns = at::ones({batch, old_columns + new_columns}, column_mask->options());
    mask_columns.narrow(1, 0, old_columns).copy_(*column_mask);
  }
  const int64_t isa = best_isa();
  const at::Tensor norm_w = norm.contiguous();
  const at::Tensor offsets = at::arange(first_fed, positions.options().dtype(at::kLong));
  at::Tensor chosen = at::empty({batch, steps}, tokens_in.options().dtype(at::kLong));
  at::Tensor confidence = at::empty({batch, steps}, embed.options());
  at::Tensor sure = sure_in.to(at::kFloat).contiguous().clone();
  at::Tensor fed = tokens_in.to(at::kLong).reshape({-1}).contiguous();
  at::Tensor feature = features.has_value() ? features->reshape({-1, width}).contiguous()
                                            : at::Tensor();
  std::vector<int64_t> columns(written.begin(), written.end());
  int64_t run = 0;
  while (run < steps) {
    const int64_t now = run == 0 ? first_fed : 1;  // positions fed a row this step
    const int64_t past = run == 0 ? 0 : first_fed + run - 1;  // new columns before them
    const at::Tensor at_positions =
        (positions.to(at::kLong).unsqueeze(1) + past + offsets.narrow(0, 0, now)).reshape({-1});
    at::Tensor hidden_in = embed.index_select(0, fed);
    if (fuse.has_value())
      hidden_in = product_of(at::cat({hidden_in, feature}, 1), *fuse, fuse_kind, isa);
    c10::optional<at::Tensor> mask;
    if (column_mask.has_value()) {
      const at::Tensor seen = mask_columns.narrow(1, 0, old_columns + past + now);
      if (now == 1) {
        mask = seen.unsqueeze(1).unsqueeze(1);
      } else {  // every query its row's columns, and the new positions up to its own
        at::Tensor several = seen.unsqueeze(1).repeat({1, now, 1});
        several.narrow(2, old_columns + past, now).copy_(at::ones({now, now}, seen.options()).tril());
        mask = several.unsqueeze(1);
      }
    }
    const at::Tensor hidden = llama_step(
        hidden_in.view({batch, now, width}), cos_table.index_select(0, at_positions),
        sin_table.index_select(0, at_positions), weights, kinds, keys, values, columns, mask,
        heads, kv_heads, head_dim, eps, scaling);
    const at::Tensor last = hidden.select(1, now - 1).contiguous();  // [batch, width]
    at::Tensor normed = at::empty({batch, width}, embed.options());
    step_ops::rms_norm(last.data_ptr<float>(), norm_w.data_ptr<float>(), batch, width,
                       static_cast<float>(norm_eps), normed.data_ptr<float>());
    const at::Tensor logits = product_of(normed, head, head_kind, isa);
    if (run == 0) fed = at::empty({batch}, fed.options());
    bool any_open = false;
    for (int64_t b = 0; b < batch; ++b) {
      int64_t index;
      float probability;
      const float* row_logits = logits.data_ptr<float>() + b * vocab;
      step_ops::top_choice(row_logits, vocab, &index, &probability);
      const int64_t* ids = head_ids.has_value() ? head_ids->data_ptr<int64_t>() : nullptr;
      int64_t token = ids != nullptr ? ids[index] : index;
      if (temperature != nullptr && temperature[b] > 0.0f) {
        const int64_t position = first_positions.data_ptr<int64_t>()[b] + first_fed + run;
        TORCH_CHECK(position < (int64_t{1} << 32), "llama_draft: a position past 2^32");
        token = sample_ops::choose_one(row_logits, vocab, temperature[b],
                                       sampling[1].data_ptr<int64_t>()[b],
                                       sampling[2].data_ptr<float>()[b],
                                       sampling[3].data_ptr<int64_t>()[b], position, ids);
      }
      chosen.data_ptr<int64_t>()[b * steps + run] = token;
      confidence.data_ptr<float>()[b * steps + run] = probability;
      fed.data_ptr<int64_t>()[b] = token;
      float& row_sure = sure.data_ptr<float>()[b];
      row_sure = row_sure * probability;
      any_open = any_open || !(row_sure < min_confidence);
    }
    feature = normed;
    for (auto& column : columns) column += now;
    ++run;
    if (min_confidence > 0.0 && !any_open) break;
  }
  return {chosen.narrow(1, 0, run), confidence.narrow(1, 0, run)};
}

// x [..., in] @ weight.T for a float32 weight [out, in], as fastlinear.weight_major computes
// it by its plan's `method`: 0 the usual product; n > 0 weight-major, the rows padded with
// zero rows to n (whose outputs are dropped).
at::Tensor dense_product(const at::Tensor& x, const at::Tensor& weight, int64_t method) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  const int64_t rows = flat.size(0);
  at::Tensor out;
  if (method == 0) {
    out = at::matmul(flat, weight.t());
  } else {
    TORCH_CHECK(method >= rows, "llama_step: a weight-major product pads, never cuts, its rows");
    const at::Tensor padded =
        method > rows ? at::constant_pad_nd(flat, {0, 0, 0, method - rows}, 0) : flat;
    out = at::matmul(weight, padded.t()).t().slice(0, 0, rows).contiguous();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return out.reshape(sizes);
}

// llama_step for float32 weights as the lean forward multiplies them (fastlinear's planned
// products, q, k and v apart, q and k rotated apart). Per layer l: weights[9l .. 9l+8] =
// input norm, q, k, v, o, post-attention norm, gate, up, down; methods[7l .. 7l+6] the
// products' plans (dense_product) for this step's rows.
at::Tensor llama_step_dense(const at::Tensor& hidden_in, const at::Tensor& cos,
                            const at::Tensor& sin, at::TensorList weights,
                            at::IntArrayRef methods, at::TensorList keys, at::TensorList values,
                            at::IntArrayRef written, const c10::optional<at::Tensor>& mask,
                            int64_t attend, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            double eps, double scaling, bool gqa) {
  const Step s{cos, sin, keys, values, written, mask, attend, heads, kv_heads, head_dim,
               eps, scaling, gqa};
  check_step(hidden_in, s, weights.size(), methods.size(), 9, 7);
  const int64_t batch = hidden_in.size(0), fed = hidden_in.size(1), width = hidden_in.size(2);
  at::Tensor hidden = hidden_in;
  for (int64_t l = 0; l < static_cast<int64_t>(keys.size()); ++l) {
    const at::Tensor* w = weights.data() + 9 * l;
    const int64_t* m = methods.data() + 7 * l;
    const at::Tensor normed = rms_norm(hidden, w[0], eps);
    const at::Tensor q = rotated(dense_product(normed, w[1], m[0])
                                     .view({batch, fed, heads, head_dim}), cos, sin);
    const at::Tensor k = rotated(dense_product(normed, w[2], m[1])
                                     .view({batch, fed, kv_heads, head_dim}), cos, sin);
    const at::Tensor v = dense_product(normed, w[3], m[2]).view({batch, fed, kv_heads, head_dim});
    hidden = hidden + dense_product(attended(s, l, q, k, v), w[4], m[3]);
    const at::Tensor inner = rms_norm(hidden, w[5], eps);
    const at::Tensor inputs =
        at::silu(dense_product(inner, w[6], m[4])) * dense_product(inner, w[7], m[5]);
    hidden = hidden + dense_product(inputs, w[8], m[6]);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY(batchspec_gguf, m) {
  m.def("q4_1_linear(Tensor x, Tensor blocks, int in_features) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor blocks, int in_features) -> Tensor");
  m.def("dequantize_q4_1(Tensor blocks, int in_features) -> Tensor");
  m.def("dequantize_q8_0(Tensor blocks, int in_features) -> Tensor");
  m.def("linear_with(Tensor x, Tensor blocks, int in_features, bool q4_1, int isa) -> Tensor");
  m.def("best_isa() -> int");
  m.def("llama_step_dense(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, "
        "int[] methods, Tensor(a!)[] keys, Tensor(b!)[] values, int[] written, Tensor? mask, "
        "int attend, int heads, int kv_heads, int head_dim, float eps, float scaling, "
        "bool gqa) -> Tensor");
  m.def("llama_step(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] kinds, "
        "Tensor(a!)[] keys, Tensor(b!)[] values, int[] written, Tensor? mask, int heads, "
        "int kv_heads, int head_dim, float eps, float scaling) -> Tensor");
  m.def("llama_draft(Tensor tokens, Tensor positions, Tensor embed, Tensor? fuse, int fuse_kind, "
        "Tensor? features, Tensor cos, Tensor sin, Tensor[] weights, int[] kinds, "
        "Tensor(a!)[] keys, Tensor(b!)[] values, int[] written, Tensor? column_mask, "
        "Tensor norm, Tensor head, int head_kind, Tensor? head_ids, Tensor[] sampling, "
        "int steps, int heads, "
        "int kv_heads, int head_dim, float eps, float scaling, float norm_eps, Tensor sure, "
        "float min_confidence) -> (Tensor, Tensor)");
  m.def("gumbel_choose(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor seeds, Tensor positions, Tensor? token_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchspec_gguf, CPU, m) {
  m.impl("q4_1_linear", q4_1_linear);
  m.impl("q8_0_linear", q8_0_linear);
  m.impl("dequantize_q4_1", dequantize_q4_1);
  m.impl("dequantize_q8_0", dequantize_q8_0);
  m.impl("linear_with", linear_with);
  m.impl("llama_step", llama_step);
  m.impl("llama_step_dense", llama_step_dense);
  m.impl("llama_draft", llama_draft);
  m.impl("gumbel_choose", sample_ops::gumbel_choose);
}

TORCH_LIBRARY_IMPL(batchspec_gguf, CompositeExplicitAutograd, m) { m.impl("best_isa", best_isa); }
