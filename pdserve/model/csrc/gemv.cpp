// Products of a few rows (1-12: the decodes of a few sequences) with a bfloat16 weight w
// [n, k] in its row-major layout: y = x w^T (+ b), float32 sums rounded to bfloat16.
// At these sizes the product only streams the weight, and oneDNN's kernels, blocked for
// batches, read it at ~12 GB/s here; row after row in order, the rows ahead asked for,
// ~23 GB/s (a one-sequence decode step of SmolLM2: its products 20.6 -> 9.8 ms, 2 Zen 4
// cores).
#include <cstdint>

#include "vec.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
using namespace pdserve;
constexpr int kAhead = 4;  // rows of w asked for ahead of their use

#if defined(__AVX512BF16__)
// 32 bfloat16 values from p, the first `valid` of them (the rest zeros).
inline __m512bh load32(const uint16_t* p, int64_t valid) {
  const __mmask32 mask = valid >= 32 ? ~__mmask32(0)
                         : valid > 0 ? (__mmask32(1) << valid) - 1 : __mmask32(0);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// Rows [r0, r0 + rows) of y for M rows of x: each weight row read once, in order.
template <int M>
void block(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t n,
           int64_t k, int64_t r0, int64_t rows) {
  alignas(64) float sums[M][kLanes] = {};
  for (int64_t j = 0; j < rows; ++j) {
    const uint16_t* row = w + (r0 + j) * k;
    if (r0 + j + kAhead < n)
      for (int64_t i = 0; i < k * 2; i += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row + kAhead * k) + i, 0, 2);
    __m512 acc[M][2];  // two chains per row: the sums of alternate 32-value runs
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; c += 64) {
      const __m512bh w0 = load32(row + c, k - c), w1 = load32(row + c + 32, k - c - 32);
      for (int m = 0; m < M; ++m) {
        const uint16_t* xm = x + m * k + c;
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], load32(xm, k - c), w0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], load32(xm + 32, k - c - 32), w1);
      }
    }
    for (int m = 0; m < M; ++m) sums[m][j] = _mm512_reduce_add_ps(acc[m][0] + acc[m][1]);
  }
  for (int m = 0; m < M; ++m) {
    f32x16 v = load(sums[m]);
    if (b) v += load_n(b + r0, rows);
    store_n(v, y + m * n + r0, rows);
  }
}

// M <= 8 rows at once (their sums fill the registers); past 8, the rest after the first 8
// on the same 16 weight rows, which are then still in L1.
template <int M>
void gemv(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t n,
          int64_t k, int threads) {
  constexpr int first = M > 8 ? 8 : M;
  const int64_t blocks = (n + kLanes - 1) / kLanes;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {  // 16 outputs of each row at a time
    const int64_t r0 = blk * kLanes, rows = n - r0 < kLanes ? n - r0 : kLanes;
    block<first>(x, w, b, y, n, k, r0, rows);
    if constexpr (M > 8) block<M - 8>(x + 8 * k, w, b, y + 8 * n, n, k, r0, rows);
  }
}
#endif
}  // namespace

// x [m, k], w [n, k], b [n] or null, y [m, n], bfloat16, rows contiguous. Returns nonzero
// where it has no kernel (no AVX512-BF16, or m outside 1..12: past 12 rows oneDNN's
// blocked products are as fast, at 16 here).
extern "C" int pdserve_gemv(const void* x, const void* w, const void* b, void* y, int64_t m,
                            int64_t n, int64_t k, int threads) {
#if defined(__AVX512BF16__)
  const auto* X = static_cast<const uint16_t*>(x);
  const auto* W = static_cast<const uint16_t*>(w);
  const auto* B = static_cast<const uint16_t*>(b);
  auto* Y = static_cast<uint16_t*>(y);
  switch (m) {
#define PDSERVE_ROWS(M) \
    case M: gemv<M>(X, W, B, Y, n, k, threads); return 0;
    PDSERVE_ROWS(1) PDSERVE_ROWS(2) PDSERVE_ROWS(3) PDSERVE_ROWS(4) PDSERVE_ROWS(5)
    PDSERVE_ROWS(6) PDSERVE_ROWS(7) PDSERVE_ROWS(8) PDSERVE_ROWS(9) PDSERVE_ROWS(10)
    PDSERVE_ROWS(11) PDSERVE_ROWS(12)
#undef PDSERVE_ROWS
    default: return 1;
  }
#else
  (void)x, (void)w, (void)b, (void)y, (void)m, (void)n, (void)k, (void)threads;
  return 1;
#endif
}
