// Decode attention straight from the paged KV cache: one query token per sequence, its keys
// and values read in place through the block table, so no gathered copy of K/V is made.
// float32 arithmetic throughout, as torch's CPU attention does for bf16 inputs.
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {
using namespace pdserve;
constexpr int kMaxGroup = 16;  // query heads per KV head

// In place over x[0, n); max and sum kept per lane, then a fixed tree.
inline void softmax(float* x, int64_t n) {
  f32x16 top = f32x16{} - INFINITY, total = {};
  for (int64_t t = 0; t < n; t += kLanes) {
    const f32x16 v = t + kLanes <= n ? load(x + t) : load_partial(x + t, n - t, -INFINITY);
    top = v > top ? v : top;
  }
  float m = -INFINITY;
  for (int i = 0; i < kLanes; ++i) m = top[i] > m ? top[i] : m;
  for (int64_t t = 0; t < n; t += kLanes) {
    if (t + kLanes <= n) {
      const f32x16 e = exp_approx(load(x + t) - m);
      store(e, x + t);
      total += e;
    } else {  // past n, lanes of zero: e^-87 there is neither stored nor counted
      const f32x16 e = exp_approx(load_partial(x + t, n - t) - m);
      store_partial(e, x + t, n - t);
      total += load_partial(x + t, n - t);
    }
  }
  const float inv = 1.f / sum(total);
  for (int64_t t = 0; t < n; ++t) x[t] *= inv;
}

struct Layout {  // element strides of the cache, already offset to one layer's K
  int64_t block, kv, token, head, dim;
  int block_size;
};

// Asks for one block's rows of one head (as `base` points) ahead of their use: blocks lie
// anywhere in the pool, which defeats the hardware's stream prefetcher at every block edge.
template <typename T>
inline void prefetch_block(const T* base, const Layout& s) {
  for (int o = 0; o < s.block_size; ++o)
    for (int64_t i = 0; i < s.dim * int64_t(sizeof(T)); i += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(base + o * s.token) + i);
}

// out[j] = sum of x[j]'s lanes, for 16 vectors at once: four rounds of pairwise halving
// leave token j's total in lane bitreverse(j), and one shuffle puts it back in lane j.
inline f32x16 lane_sums(const f32x16 (&x)[kLanes]) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                   10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                   24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  const f32x16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10,
                                           26, 12, 28, 14, 30) +
                   __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11,
                                           27, 13, 29, 15, 31);
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// Scores of m <= 16 consecutive tokens (K rows at rows[j]) for each query head g, written
// to out[g * stride + j]. qv holds the scaled queries.
template <typename T, int C>
inline void score_tokens(const f32x16 (&qv)[kMaxGroup][C], int group, const T* const* rows,
                         int m, float* out, int64_t stride) {
  f32x16 k[kLanes][C];
  for (int j = 0; j < kLanes; ++j)
    for (int c = 0; c < C; ++c) k[j][c] = j < m ? load(rows[j] + c * kLanes) : f32x16{};
  for (int g = 0; g < group; ++g) {
    f32x16 part[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      part[j] = qv[g][0] * k[j][0];
      for (int c = 1; c < C; ++c) part[j] += qv[g][c] * k[j][c];
    }
    const f32x16 sums = lane_sums(part);
    for (int j = 0; j < m; ++j) out[g * stride + j] = sums[j];
  }
}

// Calls f(t, row) for tokens t < n in order, row pointing at token t's vector in `base`:
// block by block, so there is no division per token.
template <typename T, typename F>
inline void for_each_token(const T* base, const int64_t* table, int64_t n, const Layout& s, F f) {
  for (int64_t start = 0, b = 0; start < n; start += s.block_size, ++b) {
    const T* row = base + table[b] * s.block;
    if (start + s.block_size < n) prefetch_block(base + table[b + 1] * s.block, s);
    const int64_t end = start + s.block_size < n ? start + s.block_size : n;
    for (int64_t t = start; t < end; ++t, row += s.token) f(t, row);
  }
}

// One sequence and one KV head: its `group` query heads at `q` [group, C * 16], out alike.
template <typename T, int C>
void attend_head(const T* q, T* out, const T* k0, const int64_t* table, int64_t n,
                 int group, const Layout& s, float scale, float* score) {
  f32x16 qv[kMaxGroup][C], acc[kMaxGroup][C];
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load(q + (g * C + c) * kLanes) * scale;
  const T* rows[kLanes];  // scores go 16 tokens at a time: one lane_sums, not 16 sums
  int m = 0;
  int64_t first = 0;
  auto flush = [&] {
    score_tokens<T, C>(qv, group, rows, m, score + first, n);
    first += m;
    m = 0;
  };
  for_each_token(k0, table, n, s, [&](int64_t, const T* k) {
    rows[m++] = k;
    if (m == kLanes) flush();
  });
  if (m) flush();
  for (int g = 0; g < group; ++g) {
    softmax(score + g * n, n);
    for (int c = 0; c < C; ++c) acc[g][c] = f32x16{};
  }
  for_each_token(k0 + s.kv, table, n, s, [&](int64_t t, const T* v) {
    f32x16 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load(v + c * kLanes);
    for (int g = 0; g < group; ++g) {
      const float p = score[g * n + t];
      for (int c = 0; c < C; ++c) acc[g][c] += p * vv[c];
    }
  });
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) store(acc[g][c], out + (g * C + c) * kLanes);
}

template <typename T, int C>
void attend(const T* q, T* out, const T* k0, const int64_t* tables, const int64_t* lens,
            int64_t seqs, int64_t width, int64_t heads, int64_t kv_heads, const Layout& s,
            float scale, int threads) {
  const int group = int(heads / kv_heads);
  const int64_t dim = C * kLanes;
#pragma omp parallel for num_threads(threads) schedule(dynamic) collapse(2)
  for (int64_t i = 0; i < seqs; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) {
      thread_local std::vector<float> score;
      score.resize(size_t(group) * lens[i]);
      const int64_t at = (i * heads + h * group) * dim;
      attend_head<T, C>(q + at, out + at, k0 + h * s.head, tables + i * width, lens[i], group,
                        s, scale, score.data());
    }
}

template <typename T>
int dispatch(const T* q, T* out, const T* k0, const int64_t* tables, const int64_t* lens,
             int64_t seqs, int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
             const Layout& s, float scale, int threads) {
  if (heads % kv_heads || heads / kv_heads > kMaxGroup) return 1;
  switch (dim) {
    case 64: attend<T, 4>(q, out, k0, tables, lens, seqs, width, heads, kv_heads, s, scale, threads); return 0;
    case 128: attend<T, 8>(q, out, k0, tables, lens, seqs, width, heads, kv_heads, s, scale, threads); return 0;
    default: return 1;
  }
}

}  // namespace

// q, out: [seqs, heads, dim]; k0: the cache at one layer's K of block 0; tables [seqs, width];
// strides in elements. Returns nonzero for a shape it has no kernel for.
extern "C" int pdserve_paged_decode(int bf16, const void* q, void* out, const void* k0,
                                    const int64_t* tables, const int64_t* lens, int64_t seqs,
                                    int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                                    int64_t block_size, int64_t s_block, int64_t s_kv,
                                    int64_t s_token, int64_t s_head, float scale, int threads) {
  const Layout s{s_block, s_kv, s_token, s_head, dim, int(block_size)};
  if (bf16)
    return dispatch(static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out),
                    static_cast<const uint16_t*>(k0), tables, lens, seqs, width, heads, kv_heads,
                    dim, s, scale, threads);
  return dispatch(static_cast<const float*>(q), static_cast<float*>(out),
                  static_cast<const float*>(k0), tables, lens, seqs, width, heads, kv_heads, dim,
                  s, scale, threads);
}
