// The row-wise work of a decode step beside its products, fused: RMS norm, rotation, attention
// over a layer's cache, the SiLU gate and the residual sums, each one loop over plain floats
// instead of a handful of ATen calls; and float32 products for a draft's loop.
//
// Invariants:
// - One fixed order of operations per row and per query: a position's result depends only on
//   its own inputs and on the real (unmasked) keys before it, in order; never on the batch,
//   the positions fed with it, where its keys sit in the cache (pads, holes), the threads or
//   the instruction set. So a verify of drafts computes each position exactly as a decode step
//   of that position alone does.
// - Plain multiplies and adds, never fused (the file is built with -ffp-contract=off): the
//   compiler's vector code for a loop (AVX2 or AVX-512 clones where the CPU has them, SSE2
//   elsewhere; eight lanes written with GCC's vector extension where the hot loops need it)
//   rounds every lane as the scalar code does.
// - Against ATen's operations (the lean forward) the results differ only by rounding: the
//   sums' order, and exp evaluated by its own polynomial (Cephes' expf, ~1e-7 relative).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace step_ops {

constexpr int kLanes = 8;
constexpr int64_t kMaxHeadDim = 512;

#define STEP_OPS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// Eight partial sums, then pairwise (the block kernels sum their lanes so too).
__attribute__((always_inline)) inline float lanes_sum(const float* lane) {
  const float a = lane[0] + lane[4], b = lane[1] + lane[5];
  const float c = lane[2] + lane[6], e = lane[3] + lane[7];
  return (a + c) + (b + e);
}

// Eight float32 lanes: the clone's vector registers (GCC's vector extension), one lane per
// element i % 8; each lane's arithmetic is the scalar code's.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

__attribute__((always_inline)) inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef float Quad __attribute__((vector_size(4 * sizeof(float))));
typedef int32_t QuadMask __attribute__((vector_size(4 * sizeof(int32_t))));

__attribute__((always_inline)) inline Quad low(const Lanes& v) {
  Quad q;
  std::memcpy(&q, &v, sizeof(q));
  return q;
}

__attribute__((always_inline)) inline Quad high(const Lanes& v) {
  Quad q;
  std::memcpy(&q, reinterpret_cast<const float*>(&v) + 4, sizeof(q));
  return q;
}

// sum of x[i] * y[i], element i into lane i % 8.
__attribute__((always_inline)) inline float dot(const float* x, const float* y, int64_t n) {
  Lanes acc = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(x + i) * load(y + i);
  float lane[kLanes];
  std::memcpy(lane, &acc, sizeof(lane));
  for (; i < n; ++i) lane[i % kLanes] += x[i] * y[i];
  return lanes_sum(lane);
}

// dot(x, y[k], n) for four y at once (four independent chains of sums; each in dot's order).
__attribute__((always_inline)) inline void dot4(const float* x, const float* y0,
                                                const float* y1, const float* y2,
                                                const float* y3, int64_t n, float* out) {
  const int64_t whole = n - n % kLanes;
  Lanes a = {0, 0, 0, 0, 0, 0, 0, 0}, b = a, c = a, d = a;
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Lanes v = load(x + i);
    a += v * load(y0 + i);
    b += v * load(y1 + i);
    c += v * load(y2 + i);
    d += v * load(y3 + i);
  }
  if (whole < n) {  // the tail, lane by lane
    Lanes* sums[4] = {&a, &b, &c, &d};
    const float* ys[4] = {y0, y1, y2, y3};
    for (int k = 0; k < 4; ++k) {
      float lane[kLanes];
      std::memcpy(lane, sums[k], sizeof(lane));
      for (int64_t i = whole; i < n; ++i) lane[i % kLanes] += x[i] * ys[k][i];
      std::memcpy(sums[k], lane, sizeof(lane));
    }
  }
  // lanes_sum of the four, in vector registers: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  const Quad a4 = low(a) + high(a), b4 = low(b) + high(b);
  const Quad c4 = low(c) + high(c), d4 = low(d) + high(d);
  const Quad ab = __builtin_shuffle(a4, b4, QuadMask{0, 1, 4, 5}) +
                  __builtin_shuffle(a4, b4, QuadMask{2, 3, 6, 7});
  const Quad cd = __builtin_shuffle(c4, d4, QuadMask{0, 1, 4, 5}) +
                  __builtin_shuffle(c4, d4, QuadMask{2, 3, 6, 7});
  const Quad sums = __builtin_shuffle(ab, cd, QuadMask{0, 2, 4, 6}) +
                    __builtin_shuffle(ab, cd, QuadMask{1, 3, 5, 7});
  std::memcpy(out, &sums, sizeof(sums));
}

// e^x for x in float32, Cephes' expf polynomial (~1e-7 relative); inputs beyond +-88.3 are
// clamped (e^-88.3 ~ 5e-39 stands for 0 next to any sum it joins). Plain float arithmetic, so a
// vector lane computes what the scalar code does.
__attribute__((always_inline)) inline float exp_poly(float x) {
  x = x < -88.3f ? -88.3f : (x > 88.3f ? 88.3f : x);
  // n = round(x / ln 2), by the float's own rounding past 2^23
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  // times 2^n, n in [-128, 128]: in two halves so that neither leaves the exponent's range
  const int32_t k = static_cast<int32_t>(n);
  const int32_t k1 = k / 2, k2 = k - k1;
  int32_t b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof(s1));
  std::memcpy(&s2, &b2, sizeof(s2));
  return (y * s1) * s2;
}

typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp_poly of each lane, the same operations lane by lane.
__attribute__((always_inline)) inline Lanes exp_lanes(Lanes x) {
  const Lanes low = {-88.3f, -88.3f, -88.3f, -88.3f, -88.3f, -88.3f, -88.3f, -88.3f};
  const Lanes high = -low;
  x = x < low ? low : (x > high ? high : x);
  const float magic = 12582912.0f;
  const Lanes n = (x * 1.44269504088896341f + magic) - magic;
  Lanes r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const Lanes z = r * r;
  Lanes y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const IntLanes k = __builtin_convertvector(n, IntLanes);
  const IntLanes k1 = k / 2, k2 = k - k1;
  const IntLanes b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
  Lanes s1, s2;
  std::memcpy(&s1, &b1, sizeof(s1));
  std::memcpy(&s2, &b2, sizeof(s2));
  return (y * s1) * s2;
}

// out[r] = weight * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)), rows of `width`.
STEP_OPS_CLONES void rms_norm(const float* x, const float* weight, int64_t rows, int64_t width,
                              float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float* o = out + r * width;
    const float inv = 1.0f / std::sqrt(dot(xr, xr, width) / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

// x [rows, heads, head_dim] rotated in place by row r's cos/sin [head_dim] (rows of `angles`
// apart): the first half x1 * cos - x2 * sin, the second x2 * cos + x1 * sin.
STEP_OPS_CLONES void rotate(float* x, int64_t rows, int64_t heads, int64_t row_stride,
                            int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  float first[kMaxHeadDim / 2];  // (head_dim <= kMaxHeadDim: the caller checks)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * head_dim;
    const float* s = sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * head_dim;
      std::memcpy(first, v, half * sizeof(float));
      for (int64_t i = 0; i < half; ++i) v[i] = v[i] * c[i] - v[i + half] * s[i];
      for (int64_t i = 0; i < half; ++i)
        v[i + half] = v[i + half] * c[i + half] + first[i] * s[i + half];
    }
  }
}

// out = silu(gate) * up, gate and up the halves of each row of gate_up [rows, 2 * inner].
STEP_OPS_CLONES void silu_gate(const float* gate_up, int64_t rows, int64_t inner, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * inner;
    const float* u = g + inner;
    float* o = out + r * inner;
    for (int64_t i = 0; i < inner; ++i) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
  }
}

// out[r * out_stride + o] = x[r] . weight[o] for o in [begin, end): float32 weight rows
// [out, in], summed as `dot` sums (a row's result whatever the batch or the split).
STEP_OPS_CLONES void dense_rows(const float* x, int64_t rows, int64_t in, const float* weight,
                                int64_t begin, int64_t end, float* out, int64_t out_stride) {
  int64_t o = begin;
  for (; o + 4 <= end; o += 4)
    for (int64_t r = 0; r < rows; ++r) {
      float sums[4];
      dot4(x + r * in, weight + o * in, weight + (o + 1) * in, weight + (o + 2) * in,
           weight + (o + 3) * in, in, sums);
      for (int k = 0; k < 4; ++k) out[r * out_stride + o + k] = sums[k];
    }
  for (; o < end; ++o)
    for (int64_t r = 0; r < rows; ++r)
      out[r * out_stride + o] = dot(x + r * in, weight + o * in, in);
}

// The first largest of logits [n] and its probability under their softmax (1 / the sum of
// e^(logit - largest)).
STEP_OPS_CLONES void top_choice(const float* logits, int64_t n, int64_t* index,
                                float* probability) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  const float top = logits[best];
  Lanes sum = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) sum += exp_lanes(load(logits + i) - top);
  float lane[kLanes];
  std::memcpy(lane, &sum, sizeof(lane));
  for (; i < n; ++i) lane[i % kLanes] += exp_poly(logits[i] - top);
  *index = best;
  *probability = 1.0f / lanes_sum(lane);
}

// x += y, elementwise.
STEP_OPS_CLONES void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
}

// A layer's cache: keys and values [batch, kv_heads, capacity, head_dim] by their strides
// (the last dimension contiguous).
struct Cache {
  float* keys;
  float* values;
  int64_t stride[3];  // batch, head, column (in floats; the values' the same)
};

// The attention of one query over its real keys, `picked` (n columns, in order): their scores
// against q, softmax, the values summed in the same order. `scores` has room for n floats.
// out [head_dim].
STEP_OPS_CLONES void attend_query(const float* q, const float* keys, const float* values,
                                  int64_t column_stride, const int64_t* picked, int64_t n,
                                  int64_t head_dim, float scaling, float* scores, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    dot4(q, keys + picked[i] * column_stride, keys + picked[i + 1] * column_stride,
         keys + picked[i + 2] * column_stride, keys + picked[i + 3] * column_stride, head_dim,
         scores + i);
  for (; i < n; ++i) scores[i] = dot(q, keys + picked[i] * column_stride, head_dim);
  for (i = 0; i < n; ++i) {
    scores[i] = scores[i] * scaling;
    top = scores[i] > top ? scores[i] : top;
  }
  float lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  i = 0;
  Lanes sum = {0, 0, 0, 0, 0, 0, 0, 0};
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes e = exp_lanes(load(scores + i) - top);
    std::memcpy(scores + i, &e, sizeof(e));
    sum += e;
  }
  std::memcpy(lane, &sum, sizeof(sum));
  for (; i < n; ++i) {
    scores[i] = exp_poly(scores[i] - top);
    lane[i % kLanes] += scores[i];
  }
  const float total = lanes_sum(lane);
  // each out[d] sums p * v[d] over the columns in order; eight d at a time where they fit
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) {
    Lanes sum = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = 0; j < n; ++j) sum += scores[j] * load(values + picked[j] * column_stride + d);
    sum = sum / total;
    std::memcpy(out + d, &sum, sizeof(sum));
  }
  for (; d < head_dim; ++d) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) sum += scores[j] * values[picked[j] * column_stride + d];
    out[d] = sum / total;
  }
}

// qkv [batch * fed, (heads + 2 * kv_heads) * head_dim] (q and k rotated): its keys and values
// written into the cache at columns [column, column + fed), then each query attends to its
// row's columns [0, column + fed) where `mask` [batch, 1, fed, column + fed] (bool, any
// strides) is true, or, without a mask, to every column up to its own. out [batch * fed,
// heads * head_dim].
inline void attention(const float* qkv, int64_t batch, int64_t fed, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, const Cache& cache, int64_t column,
                      const c10::optional<at::Tensor>& mask, float scaling, float* out) {
  const int64_t width = (heads + 2 * kv_heads) * head_dim;
  const int64_t groups = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < fed; ++j)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* k = qkv + (b * fed + j) * width + (heads + h) * head_dim;
        const int64_t at = b * cache.stride[0] + h * cache.stride[1] +
                           (column + j) * cache.stride[2];
        std::memcpy(cache.keys + at, k, head_dim * sizeof(float));
        std::memcpy(cache.values + at, k + kv_heads * head_dim, head_dim * sizeof(float));
      }
  const int64_t columns = column + fed;
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t ms0 = mask.has_value() ? mask->stride(0) : 0;
  const int64_t ms2 = mask.has_value() ? mask->stride(2) : 0;
  const int64_t ms3 = mask.has_value() ? mask->stride(3) : 0;
  // one task per (row, key/value head): its query heads' queries of every position fed
  const int64_t work = batch * heads * fed * columns * head_dim;
  const int64_t grain = work > (1 << 17) ? 1 : batch * kv_heads;
  at::parallel_for(0, batch * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(columns);
    std::vector<int64_t> picked(columns);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t base = b * cache.stride[0] + h * cache.stride[1];
      for (int64_t j = 0; j < fed; ++j) {
        int64_t n = 0;  // the real columns of query j, in order
        const bool* row = mp == nullptr ? nullptr : mp + b * ms0 + j * ms2;
        for (int64_t c = 0; c < columns; ++c)
          if (row != nullptr ? row[c * ms3] : c <= column + j) picked[n++] = c;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t head = h * groups + g;
          attend_query(qkv + (b * fed + j) * width + head * head_dim, cache.keys + base,
                       cache.values + base, cache.stride[2], picked.data(), n, head_dim,
                       scaling, scores.data(),
                       out + (b * fed + j) * heads * head_dim + head * head_dim);
        }
      }
    }
  });
}

}  // namespace step_ops
