// Attention straight from the paged KV cache, through the block table, with no gathered
// copy of K/V: decodes (one query token per sequence) and chunks (a prefill's queries of one
// sequence, causal), each over all earlier keys or, in a sliding-window layer, the last
// `window` of them (the query's own included, as HF masks). Gemma 2's scores may be
// soft-capped (cap * tanh(score / cap)) before the softmax. Softmax and sums in float32; a
// bfloat16 cache on a CPU with bf16 dot products (AVX512-BF16) multiplies in bf16 pairs, its
// softmax weights rounded to bf16 for the sum over V (as flash attention does), elsewhere
// float32 multiply-adds throughout.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
using namespace pdserve;
constexpr int kMaxGroup = 16;  // query heads per KV head

// bfloat16 dot products (AVX512-BF16: two products per lane and instruction, float32 sums)
// where the CPU has them; the float32 kernels elsewhere.
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
inline __m512bh pairs(uint32_t w) { return (__m512bh)_mm512_set1_epi32(int(w)); }
inline __m512bh pairs(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }
#else
constexpr bool kBf16Dot = false;
#endif

// In place over x[0, n); max and sum kept per lane, then a fixed tree.
inline void softmax(float* x, int64_t n) {
  f32x16 top = f32x16{} - INFINITY, total = {};
  for (int64_t t = 0; t < n; t += kLanes) {
    const f32x16 v = load_n(x + t, n - t, -INFINITY);
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

struct Attn {  // how scores are made: scaled, soft-capped (cap > 0), over a window (> 0)
  float scale, cap;
  int64_t window;
};

struct DecodeRows {  // where decode i's query and output lie: row index[i] of q and of out
  const int64_t* index;
  int64_t q, out;  // the rows' strides, in elements
};

struct Layout {  // element strides of the cache, already offset to one layer's K
  int64_t block, kv, token, head, dim;
  int block_size;
};

// Asks for one token's row of one head ahead of its use. Blocks lie anywhere in the pool,
// which defeats the hardware's stream prefetcher at every block edge. Into L2, not L1:
// prefetches into L1 stall the core once its few miss buffers are taken (64 decodes of 512
// tokens, 30 layers, 2 Zen 4 cores: 65 ms of attention a step into L1, 41 ms into L2).
template <typename T>
inline void prefetch_row(const T* row, const Layout& s) {
  for (int64_t i = 0; i < s.dim * int64_t(sizeof(T)); i += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(row) + i, 0, 2);
}

template <typename T>
inline void prefetch_block(const T* base, const Layout& s) {
  for (int o = 0; o < s.block_size; ++o) prefetch_row(base + o * s.token, s);
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

// The blocks a run of tokens spans: [first, first + count) of its table.
struct Span {
  int64_t first, count;
  Span(int64_t begin, int64_t n, int block_size)
      : first(begin / block_size), count(n ? (begin + n - 1) / block_size - first + 1 : 0) {}
};

// How far ahead the K pass asks for its blocks: a DRAM latency is several blocks' arithmetic
// (64 decodes of 600 tokens, 30 layers, 2 Zen 5 cores: 36.9 ms of attention a step 1 block
// ahead, in bursts; 32.5 ms 4 blocks ahead, a row with each row; 34 ms 6 ahead).
constexpr int kAhead = 4;

// Up to this many blocks whose rows a pass asks for in step with its own, one row with each
// of its rows: requests then go out evenly among the arithmetic, not in bursts that fill the
// core's miss buffers and stall it.
constexpr int kAlong = 4;
template <typename T>
struct Along {
  const T* base[kAlong];
  int count = 0;
  void add(const T* b) { base[count++] = b; }
};

// The K rows a thread reads next (the next item's KV head), asked for while the current item
// sums V. The K pass asks for V's rows as it goes, so the V pass reads from L2 and would
// leave memory idle: asking for the next K there keeps memory busy through both passes.
template <typename T>
struct Ahead {
  const T* k = nullptr;  // null: nothing known to be next
  const int64_t* table = nullptr;
  Span span{0, 0, 1};

  // Block j of `of` in the current pass takes its share of the next item's blocks.
  void share(int64_t j, int64_t of, const Layout& s, Along<T>& along) const {
    if (!k) return;
    const int64_t last = std::min((j + 1) * span.count / of, j * span.count / of + kAlong);
    for (int64_t b = j * span.count / of; b < last; ++b)
      along.add(k + table[span.first + b] * s.block);
  }
};

// Calls f(i, row) for the n tokens begin + i in order, row pointing at that token's vector
// in `base`: block by block, so there is no division per token. For each block, along(j,
// row, rows) names blocks (j: the block's ordinal in the run; row: its first row) whose rows
// are asked for in step with the block's own.
template <typename T, typename F, typename A>
inline void for_each_token(const T* base, const int64_t* table, int64_t begin, int64_t n,
                           const Layout& s, F f, A along) {
  const int64_t stop = begin + n;
  int64_t j = 0;
  for (int64_t b = begin / s.block_size, start = b * s.block_size; start < stop;
       start += s.block_size, ++b, ++j) {
    const T* row = base + table[b] * s.block;
    Along<T> rows;
    along(j, row, rows);
    const int64_t from = start > begin ? start : begin;
    const int64_t end = start + s.block_size < stop ? start + s.block_size : stop;
    row += (from - start) * s.token;
    for (int64_t t = from; t < end; ++t, row += s.token) {
      for (int i = 0; i < rows.count; ++i) prefetch_row(rows.base[i] + (t - start) * s.token, s);
      f(t - begin, row);
    }
  }
}

// The K pass of a head: f(t, row) for each token's K row, the blocks kAhead on and V's rows
// (for the V pass) asked for meanwhile.
template <typename T, typename F>
inline void for_each_key(const T* k0, const int64_t* table, int64_t begin, int64_t n,
                         const Layout& s, F f) {
  const int64_t first = begin / s.block_size, stop = begin + n;
  for (int64_t b = first; b < first + kAhead && b * s.block_size < stop; ++b)
    prefetch_block(k0 + table[b] * s.block, s);
  for_each_token(k0, table, begin, n, s, f, [&](int64_t j, const T* row, Along<T>& rows) {
    if ((first + j + kAhead) * s.block_size < stop)
      rows.add(k0 + table[first + j + kAhead] * s.block);
    rows.add(row + s.kv);
  });
}

// The V pass of a head: f(t, row) for each token's V row, the next item's K asked for
// meanwhile.
template <typename T, typename F>
inline void for_each_value(const T* k0, const int64_t* table, int64_t begin, int64_t n,
                           const Layout& s, const Ahead<T>& ahead, F f) {
  const int64_t blocks = Span(begin, n, s.block_size).count;
  for_each_token(k0 + s.kv, table, begin, n, s, f, [&](int64_t j, const T*, Along<T>& rows) {
    ahead.share(j, blocks, s, rows);
  });
}

// Gemma 2's attention logit soft-capping, in place (cap 0: none).
inline void soft_cap(float* x, int64_t n, float cap) {
  if (cap > 0)
    for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

// Calls score(rows, m, first) for the K rows of tokens first .. first + m - 1, m <= 16 at
// a time: a query's 16 scores then take one lane_sums, not 16 sums.
template <typename T, typename F>
inline void for_16_keys(const T* k0, const int64_t* table, int64_t begin, int64_t n,
                        const Layout& s, F score) {
  const T* rows[kLanes];
  int m = 0;
  int64_t first = 0;
  auto flush = [&] {
    score(rows, m, first);
    first += m;
    m = 0;
  };
  for_each_key(k0, table, begin, n, s, [&](int64_t, const T* k) {
    rows[m++] = k;
    if (m == kLanes) flush();
  });
  if (m) flush();
}

// One sequence and one KV head: its query heads at `q` [group, C * 16], out alike, over the
// n cached tokens from `begin`. G > 0 is the group size known when compiling (the
// accumulators then stay in registers), 0 any.
template <typename T, int C, int G>
void attend_head(const T* q, T* out, const T* k0, const int64_t* table, int64_t begin,
                 int64_t n, int runtime_group, const Layout& s, float scale, float cap,
                 float* score, const Ahead<T>& ahead) {
  constexpr int kG = G ? G : kMaxGroup;
  const int group = G ? G : runtime_group;
  f32x16 qv[kMaxGroup][C], acc[kG][C];
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load(q + (g * C + c) * kLanes) * scale;
  for_16_keys(k0, table, begin, n, s, [&](const T* const* rows, int m, int64_t first) {
    score_tokens<T, C>(qv, group, rows, m, score + first, n);
  });
  for (int g = 0; g < group; ++g) {
    soft_cap(score + g * n, n, cap);
    softmax(score + g * n, n);
    for (int c = 0; c < C; ++c) acc[g][c] = f32x16{};
  }
#if defined(__AVX512F__)
  for_each_value(k0, table, begin, n, s, ahead, [&](int64_t t, const T* v) {
    f32x16 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load(v + c * kLanes);
    for (int g = 0; g < group; ++g) {
      const float p = score[g * n + t];
      for (int c = 0; c < C; ++c) acc[g][c] += p * vv[c];
    }
  });
#else
  // AVX2's 16 registers hold no group's whole output: 16 tokens at a time, their V rows
  // summed 8 dims at a time for every head of the group (8-float registers: vec.h's f32x8).
  // Each output still adds the tokens in order.
  const T* rows[kLanes];
  int m = 0;
  int64_t first = 0;
  auto flush = [&] {
    for (int w = 0; w < 2 * C; ++w) {
      f32x8 a[kG];
      for (int g = 0; g < group; ++g) a[g] = half(acc[g][w / 2], w % 2);
      for (int j = 0; j < m; ++j) {
        const f32x8 v = load8(rows[j] + 8 * w);
        for (int g = 0; g < group; ++g) a[g] += (f32x8{} + score[g * n + first + j]) * v;
      }
      for (int g = 0; g < group; ++g) set_half(acc[g][w / 2], w % 2, a[g]);
    }
    first += m;
    m = 0;
  };
  for_each_value(k0, table, begin, n, s, ahead, [&](int64_t, const T* v) {
    rows[m++] = v;
    if (m == kLanes) flush();
  });
  if (m) flush();
#endif
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) store(acc[g][c], out + (g * C + c) * kLanes);
}

#if defined(__AVX512BF16__)
// attend_head for bfloat16 caches with bf16 dot products: scores two products an instruction
// with no conversion of K, and the sum over V two keys an instruction, their weights rounded
// to bfloat16 (as the chunk kernel and flash attention do); softmax in float32.
template <int C, int G>
void attend_head_bf16(const uint16_t* q, uint16_t* out, const uint16_t* k0, const int64_t* table,
                      int64_t begin, int64_t n, int runtime_group, const Layout& s, float scale,
                      float cap, float* score, uint16_t* weights, const Ahead<uint16_t>& ahead) {
  constexpr int kG = G ? G : kMaxGroup, H = C / 2;  // a head's vector: H registers of 32
  const int group = G ? G : runtime_group;
  __m512bh qb[kMaxGroup][H];
  for (int g = 0; g < group; ++g)
    for (int h = 0; h < H; ++h) qb[g][h] = pairs(q + g * C * kLanes + h * 2 * kLanes);
  for_16_keys(k0, table, begin, n, s, [&](const uint16_t* const* rows, int m, int64_t first) {
    for (int g = 0; g < group; ++g) {
      f32x16 part[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        __m512 a = _mm512_setzero_ps();
        for (int h = 0; h < H && j < m; ++h)
          a = _mm512_dpbf16_ps(a, qb[g][h], pairs(rows[j] + h * 32));
        part[j] = f32x16(a);
      }
      const f32x16 sums = lane_sums(part) * scale;
      for (int j = 0; j < m; ++j) score[g * n + first + j] = sums[j];
    }
  });
  const int64_t even = n + n % 2;  // the weights of key pairs: a zero after an odd count
  for (int g = 0; g < group; ++g) {
    soft_cap(score + g * n, n, cap);
    softmax(score + g * n, n);
    for (int64_t t = 0; t < n; t += kLanes) {
      const __m256bh b = _mm512_cvtneps_pbh(__m512(load_n(score + g * n + t, n - t)));
      std::memcpy(weights + g * even + t, &b, sizeof b);  // the buffer has room past `even`
    }
    if (n % 2) weights[g * even + n] = 0;
  }
  // Interleaving two keys' rows puts dims 8i..8i+3 of each 32 in one register's pairs and
  // 8i+4..8i+7 in the other's; the accumulators keep that order until the end.
  __m512 acc[kG][C];
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  auto fold = [&](const uint16_t* v0, const uint16_t* v1, int64_t pair) {
    for (int h = 0; h < H; ++h) {
      const __m512i a = _mm512_loadu_si512(v0 + h * 32), b = _mm512_loadu_si512(v1 + h * 32);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < group; ++g) {
        uint32_t w;
        std::memcpy(&w, weights + g * even + 2 * pair, sizeof w);
        acc[g][2 * h] = _mm512_dpbf16_ps(acc[g][2 * h], pairs(w), lo);
        acc[g][2 * h + 1] = _mm512_dpbf16_ps(acc[g][2 * h + 1], pairs(w), hi);
      }
    }
  };
  const uint16_t* held = nullptr;
  for_each_value(k0, table, begin, n, s, ahead, [&](int64_t t, const uint16_t* v) {
    if (t % 2 == 0) held = v;
    else fold(held, v, t / 2);
  });
  alignas(64) static const uint16_t zeros[C * kLanes] = {};
  if (n % 2) fold(held, zeros, n / 2);
  for (int g = 0; g < group; ++g)
    for (int h = 0; h < H; ++h) {
      const f32x16 lo = f32x16(acc[g][2 * h]), hi = f32x16(acc[g][2 * h + 1]);
      uint16_t* o = out + g * C * kLanes + h * 32;
      store(__builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22,
                                    23), o);
      store(__builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28,
                                    29, 30, 31), o + kLanes);
    }
}
#endif

template <typename T, int C, int G>
void attend(const T* q, T* out, const DecodeRows& r, const T* k0, const int64_t* tables,
            const int64_t* lens, int64_t seqs, int64_t width, int64_t heads, int64_t kv_heads,
            const Layout& s, const Attn& a, int threads) {
  const int group = int(heads / kv_heads);
  const int64_t dim = C * kLanes, items = seqs * kv_heads;  // item i * kv_heads + h
  auto keys = [&](int64_t item) {  // the item's keys: n from begin (its window's, if any)
    const int64_t len = lens[item / kv_heads];
    const int64_t begin = a.window && len > a.window ? len - a.window : 0;
    return std::pair{begin, len - begin};
  };
  auto one = [&](int64_t item, const Ahead<T>& ahead) {
    thread_local std::vector<float> score;
    const int64_t i = item / kv_heads, h = item % kv_heads;
    const auto [begin, n] = keys(item);
    score.resize(size_t(group) * n);
    const T* qi = q + r.index[i] * r.q + h * group * dim;
    T* oi = out + r.index[i] * r.out + h * group * dim;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      thread_local std::vector<uint16_t> weights;
      weights.resize(size_t(group) * (n + 1) + kLanes);
      return attend_head_bf16<C, G>(qi, oi, k0 + h * s.head, tables + i * width, begin, n,
                                    group, s, a.scale, a.cap, score.data(), weights.data(),
                                    ahead);
    }
#endif
    attend_head<T, C, G>(qi, oi, k0 + h * s.head, tables + i * width, begin, n, group, s,
                         a.scale, a.cap, score.data(), ahead);
  };
  // A sequence's KV heads on one thread, one after the other, where there are sequences
  // enough to go round: the later heads find the blocks' cache lines the first one fetched.
  const int64_t chunk = seqs >= 2 * threads ? kv_heads : 1;
  std::atomic<int64_t> claimed{0};  // items handed out, `chunk` at a time
#pragma omp parallel num_threads(threads)
  for (int64_t item = claimed.fetch_add(chunk), end = item + chunk; item < items;) {
    // The next item is claimed as this one starts, so that its K can be asked for ahead.
    int64_t next = item + 1;
    if (next == end) end = (next = claimed.fetch_add(chunk)) + chunk;
    Ahead<T> ahead;
    if (next < items) {
      const auto [begin, n] = keys(next);
      ahead = {k0 + next % kv_heads * s.head, tables + next / kv_heads * width,
               Span(begin, n, s.block_size)};
    }
    one(item, ahead);
    item = next;
  }
}

// The group sizes of common models get their own instantiation; others the generic one.
template <typename T, int C>
void attend_group(const T* q, T* out, const DecodeRows& r, const T* k0,
                  const int64_t* tables, const int64_t* lens, int64_t seqs, int64_t width,
                  int64_t heads, int64_t kv_heads, const Layout& s, const Attn& a,
                  int threads) {
  switch (heads / kv_heads) {
#define PDSERVE_GROUP(G) \
    case G: return attend<T, C, G>(q, out, r, k0, tables, lens, seqs, width, heads, kv_heads, s, a, threads);
    PDSERVE_GROUP(1) PDSERVE_GROUP(2) PDSERVE_GROUP(3) PDSERVE_GROUP(4) PDSERVE_GROUP(5)
    PDSERVE_GROUP(6) PDSERVE_GROUP(7) PDSERVE_GROUP(8)
#undef PDSERVE_GROUP
    default: return attend<T, C, 0>(q, out, r, k0, tables, lens, seqs, width, heads, kv_heads, s, a, threads);
  }
}

template <typename T>
int dispatch(const T* q, T* out, const DecodeRows& r, const T* k0, const int64_t* tables,
             const int64_t* lens, int64_t seqs, int64_t width, int64_t heads,
             int64_t kv_heads, int64_t dim, const Layout& s, const Attn& a, int threads) {
  if (heads % kv_heads || heads / kv_heads > kMaxGroup) return 1;
  switch (dim) {
    case 64: attend_group<T, 4>(q, out, r, k0, tables, lens, seqs, width, heads, kv_heads, s, a, threads); return 0;
    case 128: attend_group<T, 8>(q, out, r, k0, tables, lens, seqs, width, heads, kv_heads, s, a, threads); return 0;
    default: return 1;
  }
}

// ---- chunks: a prefill's query tokens of one sequence, each attending to the keys up to
// its own position

// The keys 16 at a time, float32: K transposed to [group][dim][16 keys] (a query's scores for
// 16 keys are then `dim` multiply-adds of whole vectors) and V as [key][dim]. Every query
// tile of a KV head reads all of them, so they are converted once per call, not per tile.
// Keys outside [begin, keys) are zeros, masked out of every score (before `begin`: out of
// every row's window, and perhaps never written).
template <typename T>
void stage_keys(const T* k0, const int64_t* table, int64_t begin, int64_t keys, int64_t dim,
                const Layout& s, int64_t h, int64_t group, float* kt, float* vf) {
  for (int64_t j = group * kLanes; j < (group + 1) * kLanes; ++j) {
    const int64_t t = j % kLanes;
    float* v = vf + j * dim;
    if (j < begin || j >= keys) {
      for (int64_t d = 0; d < dim; ++d) kt[(group * dim + d) * kLanes + t] = v[d] = 0.f;
      continue;
    }
    const T* k = k0 + table[j / s.block_size] * s.block + h * s.head +
                 j % s.block_size * s.token;
    for (int64_t d = 0; d < dim; ++d) kt[(group * dim + d) * kLanes + t] = to_float(k[d]);
    for (int64_t d = 0; d < dim; d += kLanes) store(load(k + s.kv + d), v + d);
  }
}

// The same for bfloat16 dot products: pairs of values in 32-bit words. K as [group][dim / 2]
// [16 keys] (a word: dims 2i, 2i + 1 of one key) and V as [group][8 key pairs][dim] (a
// word: keys 2j, 2j + 1 at one dim), zeros outside [begin, keys).
inline void stage_key_pairs(const uint16_t* k0, const int64_t* table, int64_t begin,
                            int64_t keys, int64_t dim, const Layout& s, int64_t h, int64_t group,
                            uint32_t* kt, uint32_t* vt) {
  const int64_t half = dim / 2;
  for (int64_t j = group * kLanes; j < (group + 1) * kLanes; j += 2) {
    const uint16_t* pair[2];
    for (int i = 0; i < 2; ++i)
      pair[i] = j + i >= begin && j + i < keys
                    ? k0 + table[(j + i) / s.block_size] * s.block + h * s.head +
                          (j + i) % s.block_size * s.token
                    : nullptr;
    for (int i = 0; i < 2; ++i)
      for (int64_t d = 0; d < half; ++d) {
        uint32_t w = 0;
        if (pair[i]) std::memcpy(&w, pair[i] + 2 * d, sizeof w);
        kt[(group * half + d) * kLanes + j % kLanes + i] = w;
      }
    uint32_t* v = vt + (group * kLanes / 2 + j % kLanes / 2) * dim;
    for (int64_t d = 0; d < dim; ++d)
      v[d] = (pair[0] ? pair[0][s.kv + d] : 0u) | uint32_t(pair[1] ? pair[1][s.kv + d] : 0u) << 16;
  }
}

inline float max_lanes(f32x16 x) {  // a tree, like sum()
  typedef float f32x4 __attribute__((vector_size(16)));
  const f32x8 lo = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 hi = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 a = lo > hi ? lo : hi;
  const f32x4 b0 = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  const f32x4 b1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 b = b0 > b1 ? b0 : b1;
  const float c0 = b[0] > b[2] ? b[0] : b[2], c1 = b[1] > b[3] ? b[1] : b[3];
  return c0 > c1 ? c0 : c1;
}

// Loaded once for several multiply-adds: left to itself GCC folds the load into each of them,
// and the loads, not the multiply-adds, then bound the loops. Only AVX-512 holds 16 floats in
// one register; elsewhere the vector is two or four, and GCC keeps them as it sees fit.
#if defined(__AVX512F__)
inline void in_register(f32x16& x) { asm("" : "+v"(x)); }
#else
inline void in_register(f32x16&) {}
#endif

constexpr int kSpan = 4;  // 16-key groups per softmax update: 64 keys share its fixed costs

// The running softmax state of R query rows of one head: max, sum, unnormalised output.
template <int C, int R>
struct Rows {
  float q[R][C * kLanes], p[R][kSpan * kLanes], m[R], l[R];  // q: the float32 path's, scaled
  uint32_t qb[R][C * kLanes / 2];  // the bfloat16 path's queries: pairs of dims, unscaled
  f32x16 o[R][C];
};

// The rows' scores for NG groups of 16 keys from group g, float32 multiply-adds.
template <int C, int R, int NG>
inline void score_span(const Rows<C, R>& st, const float* kt, int64_t g, f32x16 (&sc)[R][NG]) {
  constexpr int64_t dim = C * kLanes;
#if defined(__AVX512F__)
  for (int64_t d = 0; d < dim; ++d)
    for (int j = 0; j < NG; ++j) {
      f32x16 k = load(kt + ((g + j) * dim + d) * kLanes);
      in_register(k);
      for (int r = 0; r < R; ++r) sc[r][j] += st.q[r][d] * k;
    }
#else
  // 8-float registers, as the hardware's: GCC spills 16-float vectors' halves (and builds
  // each broadcast on the stack) when their working set is past its 16 registers.
  f32x8 acc[R][NG][2] = {};
  for (int64_t d = 0; d < dim; ++d)
    for (int j = 0; j < NG; ++j) {
      const float* k = kt + ((g + j) * dim + d) * kLanes;
      const f32x8 lo = load8(k), hi = load8(k + 8);
      for (int r = 0; r < R; ++r) {
        const f32x8 q = f32x8{} + st.q[r][d];
        acc[r][j][0] += q * lo;
        acc[r][j][1] += q * hi;
      }
    }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NG; ++j) sc[r][j] = join(acc[r][j][0], acc[r][j][1]);
#endif
}

// Folds the scores sc into the rows' running max and sum, rescaling what was summed before;
// st.p gets the span's unnormalised probabilities. Masked: the span holds keys past a row's
// own position or, in a window, before its first key, which then weigh nothing. Each step
// runs over all R rows before the next, so that their exponentials (chains of dependent
// multiply-adds) overlap rather than wait on one row's maximum at a time.
template <int C, int R, int NG, bool Masked>
inline void softmax_span(Rows<C, R>& st, f32x16 (&sc)[R][NG], int64_t g, int64_t first,
                         const Attn& a) {
  const f32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  decltype(lane < lane) valid[R][NG];
  f32x16 top[R], total[R];
  for (int r = 0; r < R; ++r) {
    top[r] = f32x16{} - INFINITY;
    total[r] = f32x16{};
    for (int j = 0; j < NG; ++j) {
      if (a.cap > 0)
        for (int i = 0; i < kLanes; ++i) sc[r][j][i] = a.cap * std::tanh(sc[r][j][i] / a.cap);
      if constexpr (Masked) {
        const int64_t key0 = (g + j) * kLanes;
        valid[r][j] = lane <= float(first + r - key0);
        if (a.window) valid[r][j] &= lane >= float(first + r - a.window + 1 - key0);
        sc[r][j] = valid[r][j] ? sc[r][j] : f32x16{} - INFINITY;
      }
      top[r] = sc[r][j] > top[r] ? sc[r][j] : top[r];
    }
  }
  float m[R];
  for (int r = 0; r < R; ++r) {
    const float t = max_lanes(top[r]);
    m[r] = t > st.m[r] ? t : st.m[r];
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NG; ++j) {
      f32x16 e = exp_no_overflow(sc[r][j] - m[r]);  // NaN where a whole span is masked
      if constexpr (Masked) e = valid[r][j] ? e : f32x16{};
      store(e, st.p[r] + j * kLanes);
      total[r] += e;
    }
  for (int r = 0; r < R; ++r) {
    if (m[r] != st.m[r]) {  // a new maximum: rescale what was summed so far
      const float alpha = exp_no_overflow(f32x16{} + (st.m[r] - m[r]))[0];
      st.l[r] *= alpha;
      for (int c = 0; c < C; ++c) st.o[r][c] *= alpha;
      st.m[r] = m[r];
    }
    st.l[r] += sum(total[r]);
  }
}

// softmax_span, masking only where the span needs it: keys up to the first row's position,
// and in a window from the last row's first key, weigh in every row.
template <int C, int R, int NG>
inline void softmax_span(Rows<C, R>& st, f32x16 (&sc)[R][NG], int64_t g, int64_t first,
                         const Attn& a) {
  if ((g + NG) * kLanes - 1 > first || (a.window && g * kLanes < first + R - a.window))
    softmax_span<C, R, NG, true>(st, sc, g, first, a);
  else
    softmax_span<C, R, NG, false>(st, sc, g, first, a);
}

// Folds NG groups of 16 keys, from group g, into the rows' state (float32 throughout).
template <int C, int R, int NG>
inline void fold_span(Rows<C, R>& st, const float* kt, const float* vf, int64_t g,
                      int64_t first, const Attn& a) {
  constexpr int64_t dim = C * kLanes;
  f32x16 sc[R][NG] = {};
  score_span<C, R, NG>(st, kt, g, sc);
  softmax_span<C, R, NG>(st, sc, g, first, a);
#if defined(__AVX512F__)
  f32x16 o[R][C];  // in registers for the loop (V's floats could alias st.o for the compiler)
  std::memcpy(o, st.o, sizeof o);
  for (int t = 0; t < NG * kLanes; ++t) {
    f32x16 v[C];
    for (int c = 0; c < C; ++c) {
      v[c] = load(vf + (g * kLanes + t) * dim + c * kLanes);
      in_register(v[c]);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) o[r][c] += st.p[r][t] * v[c];
  }
  std::memcpy(st.o, o, sizeof o);
#else
  // 8-float registers (see score_span), the rows' outputs 8 registers at a time
  constexpr int W = 2 * C, B = (8 / R < W ? 8 / R : W);
  for (int w0 = 0; w0 < W; w0 += B) {
    f32x8 o[R][B];
    for (int r = 0; r < R; ++r)
      std::memcpy(o[r], reinterpret_cast<const float*>(st.o[r]) + w0 * 8, sizeof o[r]);
    for (int t = 0; t < NG * kLanes; ++t) {
      const float* v = vf + (g * kLanes + t) * dim + w0 * 8;
      for (int r = 0; r < R; ++r) {
        const f32x8 p = f32x8{} + st.p[r][t];
        for (int w = 0; w < B; ++w) o[r][w] += p * load8(v + w * 8);
      }
    }
    for (int r = 0; r < R; ++r)
      std::memcpy(reinterpret_cast<float*>(st.o[r]) + w0 * 8, o[r], sizeof o[r]);
  }
#endif
}

#if defined(__AVX512BF16__)

// fold_span for bfloat16 caches on CPUs with bf16 dot products (AVX512-BF16): scores and the
// weighted sum of V take two products per instruction, with float32 sums; the weights are
// rounded to bfloat16 for the second (as flash attention does on GPUs), the softmax stays
// float32. Twice the multiply-adds per instruction of the float32 path.
template <int C, int R, int NG>
inline void fold_span_bf16(Rows<C, R>& st, const uint32_t* kt, const uint32_t* vt, int64_t g,
                           int64_t first, const Attn& a) {
  constexpr int64_t dim = C * kLanes, half = dim / 2;
  __m512 acc[R][NG];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < half; ++d)
    for (int j = 0; j < NG; ++j) {
      const __m512bh k = pairs(kt + ((g + j) * half + d) * kLanes);
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pairs(st.qb[r][d]), k);
    }
  f32x16 sc[R][NG];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NG; ++j) sc[r][j] = f32x16(acc[r][j]) * a.scale;
  softmax_span<C, R, NG>(st, sc, g, first, a);
  uint32_t p[R][NG * kLanes / 2];  // the weights as bfloat16 pairs of consecutive keys
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NG; ++j) {
      const __m256bh b = _mm512_cvtneps_pbh(__m512(load(st.p[r] + j * kLanes)));
      std::memcpy(p[r] + j * kLanes / 2, &b, sizeof b);
    }
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = __m512(st.o[r][c]);
  for (int t = 0; t < NG * kLanes / 2; ++t) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = pairs(vt + (g * kLanes / 2 + t) * dim + c * kLanes);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pairs(p[r][t]), v[c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) st.o[r][c] = f32x16(o[r][c]);
}
#endif

// Staged keys: float32 (see stage_keys), or bfloat16 pairs in 32-bit words where the CPU has
// bf16 dot products (stage_key_pairs).
template <typename T>
using Staged = std::conditional_t<kBf16Dot && std::is_same_v<T, uint16_t>, uint32_t, float>;

template <int C, int R, int NG>
inline void fold(Rows<C, R>& st, const float* kt, const float* vf, int64_t g, int64_t first,
                 const Attn& a) {
  fold_span<C, R, NG>(st, kt, vf, g, first, a);
}
#if defined(__AVX512BF16__)
template <int C, int R, int NG>
inline void fold(Rows<C, R>& st, const uint32_t* kt, const uint32_t* vt, int64_t g,
                 int64_t first, const Attn& a) {
  fold_span_bf16<C, R, NG>(st, kt, vt, g, first, a);
}
#endif

// The first 16-key group a tile starting at `position` reads: 0, or in a window the span
// (kSpan groups) holding the tile's first row's earliest key.
inline int64_t first_span(int64_t position, int64_t window) {
  const int64_t key = window && position >= window ? position - window + 1 : 0;
  return key / (kSpan * kLanes) * kSpan;
}

// R consecutive query rows of one head, at positions first, first + 1, ...: R divides 16 and
// a tile's rows never straddle a multiple of 16, so every row of a tile ends in the same
// 16-key group, and spans start at fixed multiples of kSpan groups: each row's arithmetic is
// the same whatever chunk or tile it comes in (a prompt computed in one chunk or several gives
// bit-identical results). `rows` < R at a chunk's edges.
template <typename T, int C, int R>
void start_rows(Rows<C, R>& st, const T* q, int64_t q_stride, int rows, const Attn& a) {
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) st.o[r][c] = f32x16{};
    if constexpr (std::is_same_v<Staged<T>, uint32_t>) {  // pairs of bf16 dims, unscaled
      for (int d = 0; d < C * kLanes / 2; ++d)
        st.qb[r][d] = r < rows ? uint32_t(q[r * q_stride + 2 * d]) |
                                     uint32_t(q[r * q_stride + 2 * d + 1]) << 16
                               : 0u;
    } else {
      for (int c = 0; c < C; ++c) {
        const f32x16 x = r < rows ? load(q + r * q_stride + c * kLanes) * a.scale : f32x16{};
        store(x, st.q[r] + c * kLanes);
      }
    }
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
  }
}

// Folds the span of groups from g (at most kSpan, none past `last`) into the rows' state.
template <typename T, int C, int R>
inline void fold_any(Rows<C, R>& st, const Staged<T>* kt, const Staged<T>* vt, int64_t g,
                     int64_t last, int64_t first, const Attn& a) {
  switch (last - g + 1 < kSpan ? int(last - g + 1) : kSpan) {
    case 1: return fold<C, R, 1>(st, kt, vt, g, first, a);
    case 2: return fold<C, R, 2>(st, kt, vt, g, first, a);
    case 3: return fold<C, R, 3>(st, kt, vt, g, first, a);
    default: return fold<C, R, kSpan>(st, kt, vt, g, first, a);
  }
}

template <typename T, int C, int R>
void finish_rows(const Rows<C, R>& st, T* out, int64_t out_stride, int rows) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c)
      store(st.o[r][c] * (1.f / st.l[r]), out + r * out_stride + c * kLanes);
}

// The query positions [start, end) of one 16-aligned tile, for `heads` query heads of one KV
// head (q and out at the tile's first row and first head), swept span by span: a span's
// staged K and V (16 KB at dim 64) come from L3 once for every row of the unit and stay in L1
// while its R-row sub-tiles fold them in. One row tile at a time read each span once per R
// rows, and an 8k-token prompt's attention was bound by that traffic.
template <typename T, int C, int R>
void attend_tile(const T* q, int64_t q_stride, T* out, int64_t out_stride, const Staged<T>* kt,
                 const Staged<T>* vt, int64_t start, int64_t end, int heads, const Attn& a) {
  constexpr int64_t dim = C * kLanes;
  constexpr int S = kLanes / R;  // sub-tiles of a head
  // The sub-tiles holding [start, end): i0 .. i1 - 1, sub-tile i from the multiple of R it
  // starts at (or `start`), to the next (or `end`).
  const int64_t base = start / kLanes * kLanes;
  const int i0 = int((start - base) / R), i1 = int((end - base + R - 1) / R);
  int64_t first[S];
  int rows[S];
  for (int i = i0; i < i1; ++i) {
    const int64_t lo = base + i * R;
    first[i] = lo > start ? lo : start;
    rows[i] = int((lo + R < end ? lo + R : end) - first[i]);
  }
  thread_local std::vector<Rows<C, R>> st;
  st.resize(size_t(heads) * S);
  for (int h = 0; h < heads; ++h)
    for (int i = i0; i < i1; ++i)
      start_rows<T, C, R>(st[h * S + i], q + (first[i] - start) * q_stride + h * dim, q_stride,
                          rows[i], a);
  const int64_t last = start / kLanes;
  for (int64_t g = first_span(start, a.window); g <= last; g += kSpan)
    for (int h = 0; h < heads; ++h)
      for (int i = i0; i < i1; ++i) fold_any<T, C, R>(st[h * S + i], kt, vt, g, last, first[i], a);
  for (int h = 0; h < heads; ++h)
    for (int i = i0; i < i1; ++i)
      finish_rows<T, C, R>(st[h * S + i], out + (first[i] - start) * out_stride + h * dim,
                           out_stride, rows[i]);
}

template <typename T>
inline void stage(const T* k0, const int64_t* table, int64_t begin, int64_t keys, int64_t dim,
                  const Layout& s, int64_t h, int64_t g, Staged<T>* kt, Staged<T>* vt) {
  if constexpr (std::is_same_v<Staged<T>, uint32_t>)
    stage_key_pairs(k0, table, begin, keys, dim, s, h, g, kt, vt);
  else
    stage_keys(k0, table, begin, keys, dim, s, h, g, kt, vt);
}

template <typename T, int C>
void attend_chunk(const T* q, int64_t q_stride, T* out, int64_t out_stride, const T* k0,
                  const int64_t* table, int64_t n, int64_t pos, int64_t heads,
                  int64_t kv_heads, const Layout& s, const Attn& a, int threads) {
  // O's accumulators fill half the vector registers (AVX-512's 32); with AVX2's 16, two rows
  // (the fastest of 1, 2 and 4 at head_dim 64 and 128 on Zen 3)
#if defined(__AVX512F__)
  constexpr int R = 16 / C;
#else
  constexpr int R = 2;
#endif
  constexpr int64_t dim = C * kLanes;
  const int64_t keys = pos + n, groups = (keys + kLanes - 1) / kLanes, group = heads / kv_heads;
  const int64_t first_tile = pos / kLanes, tiles = groups - first_tile;
  // A unit: one tile and a KV head's whole group of query heads (they read the same K/V),
  // or one query head where that leaves too few units to share among the threads.
  const int64_t unit_heads = tiles * kv_heads >= 4 * threads ? group : 1;
  const int64_t units = heads / unit_heads;
  // One KV head's staged K, then its V: a value per word in float32, two in bf16 pairs.
  const int64_t per_head = groups * kLanes * dim / (std::is_same_v<Staged<T>, float> ? 1 : 2);
  thread_local std::vector<Staged<T>> staged;
  staged.resize(size_t(2 * kv_heads * per_head));
  Staged<T>* kt = staged.data();
  Staged<T>* vt = kt + kv_heads * per_head;
  // In a window: the groups the first tile reads on, and the first key any row sees.
  const int64_t first_group = first_span(pos, a.window);
  const int64_t begin = a.window && pos >= a.window ? pos - a.window + 1 : 0;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for collapse(2)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = first_group; g < groups; ++g)
        stage(k0, table, begin, keys, dim, s, h, g, kt + h * per_head, vt + h * per_head);
#pragma omp for schedule(dynamic) collapse(2)
    for (int64_t i = tiles - 1; i >= 0; --i)  // the longest rows first: better balance
      for (int64_t u = 0; u < units; ++u) {
        const int64_t start = (first_tile + i) * kLanes > pos ? (first_tile + i) * kLanes : pos;
        const int64_t end = (first_tile + i + 1) * kLanes < keys ? (first_tile + i + 1) * kLanes
                                                                  : keys;
        const int64_t row = start - pos, hq = u * unit_heads, h = hq / group;
        attend_tile<T, C, R>(q + row * q_stride + hq * dim, q_stride,
                             out + row * out_stride + hq * dim, out_stride, kt + h * per_head,
                             vt + h * per_head, start, end, int(unit_heads), a);
      }
  }
}

template <typename T>
int dispatch_chunk(const T* q, int64_t q_stride, T* out, int64_t out_stride, const T* k0,
                   const int64_t* table, int64_t n, int64_t pos, int64_t heads,
                   int64_t kv_heads, int64_t dim, const Layout& s, const Attn& a, int threads) {
  if (heads % kv_heads) return 1;
  switch (dim) {
    case 64: attend_chunk<T, 4>(q, q_stride, out, out_stride, k0, table, n, pos, heads, kv_heads, s, a, threads); return 0;
    case 128: attend_chunk<T, 8>(q, q_stride, out, out_stride, k0, table, n, pos, heads, kv_heads, s, a, threads); return 0;
    default: return 1;
  }
}

}  // namespace

// Decode i's query is row rows[i] of q (rows q_stride elements apart, each [heads, dim]),
// its output the same row of out (out_stride apart): a step's decodes are read and written in
// place among its other tokens. k0: the cache at one layer's K of block 0; tables [seqs,
// width]; strides in elements; scores are q.k * scale, capped at `cap` (> 0), over the last
// `window` tokens (> 0) or all. Returns nonzero for a shape it has no kernel for.
extern "C" int pdserve_paged_decode(int bf16, const void* q, int64_t q_stride, void* out,
                                    int64_t out_stride, const int64_t* rows, const void* k0,
                                    const int64_t* tables, const int64_t* lens, int64_t seqs,
                                    int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                                    int64_t block_size, int64_t s_block, int64_t s_kv,
                                    int64_t s_token, int64_t s_head, float scale, float cap,
                                    int64_t window, int threads) {
  const Layout s{s_block, s_kv, s_token, s_head, dim, int(block_size)};
  const Attn a{scale, cap, window};
  const DecodeRows r{rows, q_stride, out_stride};
  if (bf16)
    return dispatch(static_cast<const uint16_t*>(q), static_cast<uint16_t*>(out), r,
                    static_cast<const uint16_t*>(k0), tables, lens, seqs, width, heads, kv_heads,
                    dim, s, a, threads);
  return dispatch(static_cast<const float*>(q), static_cast<float*>(out), r,
                  static_cast<const float*>(k0), tables, lens, seqs, width, heads, kv_heads, dim,
                  s, a, threads);
}

// q [n, heads, dim] and out alike, rows `q_stride` and `out_stride` elements apart: the n query
// tokens of one sequence at positions pos, pos + 1, ..., whose K/V are already in the cache;
// token i attends to the first pos + i + 1 tokens of block table `table` (the last `window`
// of them where window > 0); scale and cap as for decodes.
extern "C" int pdserve_paged_chunk(int bf16, const void* q, int64_t q_stride, void* out,
                                   int64_t out_stride, const void* k0, const int64_t* table,
                                   int64_t n, int64_t pos, int64_t heads, int64_t kv_heads,
                                   int64_t dim, int64_t block_size, int64_t s_block,
                                   int64_t s_kv, int64_t s_token, int64_t s_head, float scale,
                                   float cap, int64_t window, int threads) {
  const Layout s{s_block, s_kv, s_token, s_head, dim, int(block_size)};
  const Attn a{scale, cap, window};
  if (bf16)
    return dispatch_chunk(static_cast<const uint16_t*>(q), q_stride, static_cast<uint16_t*>(out),
                          out_stride, static_cast<const uint16_t*>(k0), table, n, pos, heads,
                          kv_heads, dim, s, a, threads);
  return dispatch_chunk(static_cast<const float*>(q), q_stride, static_cast<float*>(out),
                        out_stride, static_cast<const float*>(k0), table, n, pos, heads,
                        kv_heads, dim, s, a, threads);
}
