// The seeded Gumbel-max choice of sampled rows (sampling.gumbel_max) in one pass a row: the
// argmax over the row's kept set (temperature, top-k, top-p) of logit / temperature +
// gumbel(seed, position, token), the lowest token on a tie.
//
// Invariants:
// - The noise is sampling.gumbel's, bit for bit: murmur3's finalizer keyed by the seed, a 24-bit
//   uniform, -log(-log(u)) in double rounded to float32. A score is the float32 sum of the
//   scaled logit (one float32 division) and that noise, as in the torch code.
// - The kept set is a prefix of the tokens in descending scaled logit (ties: lower token first):
//   the first top_k, and of those the ones the mass before which (exp(s - norm), summed in
//   double, each sum rounded to float32) is below top_p, norm the logsumexp of the top-k set or
//   of the whole row. Against the torch code only the rounding of norm and of exp differ, so the
//   two can disagree only on a token whose mass before lies within ~1e-7 of top_p.
// - Noise is computed only where it can win: a token whose scaled logit is below the best score
//   found so far minus G_MAX (the largest noise) minus a float32 slack of 1 cannot win.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "step_ops.h"

namespace sample_ops {

// -log(-log(1 - 2^-25)): no noise exceeds it (sampling.G_MAX); and the slack beyond it
constexpr float kGMax = 17.328679499097472f;
constexpr float kSlack = 1.0f;
constexpr int64_t kFirstChunk = 64;
constexpr int64_t kNoToken = std::numeric_limits<int64_t>::max();

inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  return x ^ (x >> 33);
}

inline uint64_t cell_hash(uint64_t key, uint64_t position, uint64_t token) {
  return mix(mix(((position << 32) | token) ^ key) + key);
}

// sampling.gumbel of a cell's hash: -log(-log(u)), u = (top 24 bits + 1/2) / 2^24
inline float gumbel_of(uint64_t hashed) {
  const double u = (static_cast<double>(hashed >> 40) + 0.5) * 0x1p-24;
  return static_cast<float>(-std::log(-std::log(u)));
}

// kFloor[j]: the least 24-bit k whose noise exceeds j - 1 (j = 0 .. 19), so a cell with
// k < kFloor[j] has noise of at most j - 1: it cannot lift a token j or more below a score.
struct Floors {
  uint64_t at[20];
  Floors() {
    for (int j = 0; j < 20; ++j) {
      uint64_t lo = 0, hi = uint64_t{1} << 24;  // the first k with noise > j - 1
      while (lo < hi) {
        const uint64_t mid = (lo + hi) / 2;
        if (gumbel_of(mid << 40) > static_cast<float>(j - 1)) hi = mid; else lo = mid + 1;
      }
      at[j] = lo;
    }
  }
};
inline const Floors kFloors;

// out[i] = x[i] / t
STEP_OPS_CLONES void scale_into(const float* x, int64_t n, float t, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / t;
}

// max of x[0 .. n)
STEP_OPS_CLONES float max_of(const float* x, int64_t n) {
  float lane[step_ops::kLanes];
  for (int l = 0; l < step_ops::kLanes; ++l) lane[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + step_ops::kLanes <= n; i += step_ops::kLanes)
    for (int l = 0; l < step_ops::kLanes; ++l) lane[l] = x[i + l] > lane[l] ? x[i + l] : lane[l];
  float best = -std::numeric_limits<float>::infinity();
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  for (int l = 0; l < step_ops::kLanes; ++l) best = lane[l] > best ? lane[l] : best;
  return best;
}

// out[i] = e^(x[i] - top)
STEP_OPS_CLONES void exp_into(const float* x, int64_t n, float top, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = step_ops::exp_poly(x[i] - top);
}

// sum of x[0 .. n) in double, element i into lane i % 8
STEP_OPS_CLONES double double_sum(const float* x, int64_t n) {
  double lane[step_ops::kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + step_ops::kLanes <= n; i += step_ops::kLanes)
    for (int l = 0; l < step_ops::kLanes; ++l) lane[l] += static_cast<double>(x[i + l]);
  for (; i < n; ++i) lane[i % step_ops::kLanes] += static_cast<double>(x[i]);
  double sum = 0;
  for (int l = 0; l < step_ops::kLanes; ++l) sum += lane[l];
  return sum;
}

struct Row {
  const float* logits;  // [vocab]
  int64_t vocab;
  float temperature;
  int64_t limit;  // top-k (vocab: all)
  float top_p;
  uint64_t key;  // mix(seed ^ golden)
  uint64_t position;
  const int64_t* token_ids;  // a column's token; nullptr: the column itself

  int64_t token(int64_t column) const { return token_ids ? token_ids[column] : column; }
};

// The running argmax of score (ties: lower token); noise is drawn only where it can reach.
struct Best {
  float score = -std::numeric_limits<float>::infinity();
  int64_t token = kNoToken;

  void offer(float scaled, int64_t token_id, const Row& row) {
    const uint64_t hashed = cell_hash(row.key, row.position, static_cast<uint64_t>(token_id));
    const float short_of = score - scaled;  // the noise it needs to tie
    if (short_of >= 1.0f && short_of < 20.0f &&
        (hashed >> 40) < kFloors.at[static_cast<int>(short_of)])
      return;  // its noise is at most short_of - 1
    const float score_here = scaled + gumbel_of(hashed);
    if (score_here > score || (score_here == score && token_id < token)) {
      score = score_here;
      token = token_id;
    }
  }
  bool beyond_reach(float scaled) const { return scaled < score - (kGMax + kSlack); }
};

// Every token kept: noise only for tokens within reach of the best so far, the best scaled
// logit first (it bounds the rest).
inline int64_t choose_whole(const Row& row, const float* scaled) {
  const float top = max_of(scaled, row.vocab);
  Best best;
  for (int64_t c = 0; c < row.vocab; ++c)
    if (scaled[c] == top) {
      best.offer(top, row.token(c), row);
      break;
    }
  for (int64_t c = 0; c < row.vocab; ++c)
    if (!best.beyond_reach(scaled[c])) best.offer(scaled[c], row.token(c), row);
  return best.token;
}

using Item = std::pair<float, int64_t>;  // (scaled logit, token)

inline bool before(const Item& a, const Item& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// How many of items, in order, the row keeps (top-k, then top-p by `norm`); -1 where the
// items run out with the set still open (it may hold tokens that are not among them). Sorts
// the items' prefix as far as it walks, a chunk at a time.
inline int64_t kept_prefix(std::vector<Item>& items, const Row& row, float norm) {
  const int64_t size = static_cast<int64_t>(items.size());
  const bool by_p = row.top_p < 1.0f;
  double mass = 0;
  for (int64_t begin = 0, chunk = kFirstChunk; begin < size; begin += chunk, chunk *= 4) {
    const int64_t end = std::min(size, begin + chunk);
    if (end < size) std::nth_element(items.begin() + begin, items.begin() + end, items.end(), before);
    std::sort(items.begin() + begin, items.begin() + end, before);
    for (int64_t i = begin; i < end; ++i) {
      if (i >= row.limit) return i;
      if (by_p) {  // as torch: cumsum (double, rounded to float32) minus p, below top_p
        const float p = std::exp(items[i].first - norm);
        mass += static_cast<double>(p);
        if (!(static_cast<float>(mass) - p < row.top_p)) return i;
      }
    }
  }
  return size >= row.limit ? size : -1;
}

// The choice of a row under top-k and/or top-p: its tokens within a band below the best are
// ordered until the kept set ends; a wider band where it does not end inside. Tokens at -inf
// (a grammar's forbidden ones) are never kept: none of them could win.
inline int64_t choose_kept(const Row& row, const float* scaled, std::vector<Item>& items) {
  const float top = max_of(scaled, row.vocab);
  const bool by_k = row.limit < row.vocab, by_p = row.top_p < 1.0f;
  const float inf = std::numeric_limits<float>::infinity();
  float norm = 0;
  if (by_p && !by_k) {  // logsumexp of the row
    thread_local std::vector<float> terms;
    terms.resize(row.vocab);
    exp_into(scaled, row.vocab, top, terms.data());
    norm = static_cast<float>(static_cast<double>(top) +
                              std::log(double_sum(terms.data(), row.vocab)));
  }
  for (float band : {8.0f, 16.0f, 32.0f, inf}) {
    const bool last = band == inf;
    const float floor = top - band;
    items.clear();
    for (int64_t c = 0; c < row.vocab; ++c)
      if (scaled[c] >= floor && scaled[c] > -inf) items.emplace_back(scaled[c], row.token(c));
    const int64_t size = static_cast<int64_t>(items.size());
    if (size == 0) return row.token(0);  // every token at -inf: the first (as torch's argmax)
    if (by_k && size < row.limit && !last) continue;  // the top-k set lies beyond
    if (by_k && by_p) {  // logsumexp of the top-k set
      const int64_t count = std::min(row.limit, size);
      std::nth_element(items.begin(), items.begin() + (count - 1), items.end(), before);
      double sum = 0;
      for (int64_t i = 0; i < count; ++i)
        sum += static_cast<double>(step_ops::exp_poly(items[i].first - top));
      norm = static_cast<float>(static_cast<double>(top) + std::log(sum));
    }
    int64_t kept = kept_prefix(items, row, norm);
    if (kept < 0 && !last) continue;
    if (kept < 0) kept = size;
    Best best;  // the kept prefix is in order: noise until a token is out of reach
    for (int64_t i = 0; i < kept && !best.beyond_reach(items[i].first); ++i)
      best.offer(items[i].first, items[i].second, row);
    return best.token;
  }
  return kNoToken;  // not reached: the last band holds every token above -inf
}

// The token one row of logits [vocab] chooses under its settings (temperature > 0; top_k 0:
// none; a position below 2^32), as gumbel_choose chooses it.
inline int64_t choose_one(const float* logits, int64_t vocab, float temperature, int64_t top_k,
                          float top_p, int64_t seed, int64_t position, const int64_t* ids) {
  thread_local std::vector<float> scaled;
  thread_local std::vector<Item> items;
  scaled.resize(vocab);
  const Row row{logits, vocab, temperature, top_k > 0 ? std::min(top_k, vocab) : vocab, top_p,
                mix(static_cast<uint64_t>(seed) ^ 0x9E3779B97F4A7C15ull),
                static_cast<uint64_t>(position), ids};
  scale_into(row.logits, vocab, row.temperature, scaled.data());
  return row.limit >= vocab && row.top_p >= 1.0f ? choose_whole(row, scaled.data())
                                                  : choose_kept(row, scaled.data(), items);
}

// tokens [n] for logits [n, vocab] float32 and each row's settings (sampling.gumbel_max)
inline at::Tensor gumbel_choose(const at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& top_k, const at::Tensor& top_p,
                                const at::Tensor& seeds, const at::Tensor& positions,
                                const c10::optional<at::Tensor>& token_ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "gumbel_choose: logits must be [rows, vocab] contiguous float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "gumbel_choose: an empty vocabulary");
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &seeds, &positions})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->is_contiguous(),
                "gumbel_choose: one contiguous setting per row");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_p.scalar_type() == at::kFloat &&
                  top_k.scalar_type() == at::kLong && seeds.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "gumbel_choose: float32 temperature and top_p, int64 top_k, seeds, positions");
  const int64_t* ids = nullptr;
  if (token_ids.has_value()) {
    TORCH_CHECK(token_ids->dim() == 1 && token_ids->size(0) == vocab &&
                    token_ids->scalar_type() == at::kLong && token_ids->is_contiguous(),
                "gumbel_choose: token_ids must be [vocab] contiguous int64");
    ids = token_ids->data_ptr<int64_t>();
  }
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  const float* p = top_p.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const int64_t* s = seeds.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(t[r] > 0 && pos[r] >= 0 && pos[r] < (int64_t{1} << 32),
                "gumbel_choose: temperature > 0 and 0 <= position < 2^32");
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      o[r] = choose_one(x + r * vocab, vocab, t[r], k[r], p[r], s[r], pos[r], ids);
  });
  return out;
}

}  // namespace sample_ops
