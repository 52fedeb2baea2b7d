// Products of up to ~128 rows (decode batches, short chunks) with a bfloat16 weight w [n, k]
// laid out for AVX512-BF16 dot products: y = x w^T (+ b), float32 sums rounded once to
// bfloat16.
//
// The layout, "pair-packed": for each block of 16 outputs and each pair of inputs (2p, 2p+1),
// the 16 outputs' two weights side by side, [ceil(n/16)][k/2][16][2]. One dot-product
// instruction then multiplies a broadcast pair of x by a 64-byte load of w and adds into the
// 16 outputs' float32 sums: no horizontal sums, and each weight load serves 12 rows of x.
// A tile is 12 rows by 2 blocks (24 accumulators in registers); while the tiles of a panel of
// 2 blocks run, the next panel is asked for into L2, so the weights stream in while the
// products run, and a panel of 576 inputs (36 KB) stays in L1 for the next tiles. 121
// products of SmolLM2's shapes on 2 Zen 5 cores, 8 / 24 / 64 / 128 rows: 7.2-7.5 / 8.4-9.0 /
// 20.5-21.4 / 38.1-38.3 ms against oneDNN's 8.8-9.4 / 12.8-13.3 / 25.4-26.0 / 41.9-42.3
// (the next panel asked for by the first tile alone: 7.4-7.9 / 9.3-10.1 / 21.0-22.0 /
// 39.5-40.5; tiles of 6 x 4: 9.0 / 12.5 / 19.4 / 24.1 at 8-64 rows, on another day's
// oneDNN 9.2 / 13.7 / 21.4 / 27.1); even at 256.
// Each output's sum runs over k in the same order whatever the number of rows or the tile,
// so a row's result does not depend on the batch it came in.
//
// Gated: w is an MLP's gate and up with their blocks interleaved (gate's block j, then up's),
// and a tile's epilogue writes silu(gate) * up, each rounded where pdserve_silu_mul rounds
// it: the product and the activation in one pass, with no [m, 2 * I] result to write and
// read again.
#include <algorithm>
#include <cstdint>
#include <utility>

#include "vec.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#endif

namespace {
using namespace pdserve;

#if defined(__AVX512BF16__)
constexpr int kRows = 12, kBlocks = 2;  // a tile: rows of x by blocks of 16 outputs

struct Panel {  // kBlocks or fewer blocks of w, and where their outputs go
  const uint16_t* w;  // the first block's pairs
  const uint16_t* next;  // the next panel's, to ask for ahead (null: none)
  int64_t next_blocks, col;  // blocks in the next panel; this panel's first output
  // The panel's tiles share asking for the next one: tile `phase` of `every` asks for pairs
  // phase, phase + every, ..., one k step in `every`, so that the weights stream in evenly
  // through the panel's tiles, not in a burst during its first.
  int64_t every, phase;
};

template <int R, int B, bool Gated>
void tile(const uint16_t* x, const Panel& pn, const uint16_t* bias, uint16_t* y, int64_t n,
          int64_t k) {
  const int64_t pairs = k / 2, stride = pairs * 32;  // one block's pairs
  __m512 acc[R][B];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < B; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t due = pn.next ? pn.phase : pairs;  // the next pair to ask for
  for (int64_t p = 0; p < pairs; ++p) {
    if (p == due) {
      for (int64_t j = 0; j < pn.next_blocks; ++j)
        __builtin_prefetch(pn.next + j * stride + p * 32, 0, 2);
      due += pn.every;
    }
    __m512bh w[B];
    for (int j = 0; j < B; ++j) w[j] = (__m512bh)_mm512_loadu_si512(pn.w + j * stride + p * 32);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * k + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < B; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, w[j]);
    }
  }
  if constexpr (Gated) {  // y [R, n / 2]; n a whole number of block pairs
    static_assert(B == 2, "a gated tile is one gate block and its up block");
    for (int i = 0; i < R; ++i)  // rounded as the plain epilogue stores them (+ 0: no bias)
      store(silu_times<uint16_t>(round_to<uint16_t>(f32x16(acc[i][0]) + f32x16{}),
                                 round_to<uint16_t>(f32x16(acc[i][1]) + f32x16{})),
            y + i * (n / 2) + pn.col / 2);
    return;
  }
  for (int j = 0; j < B; ++j) {
    const int64_t col = pn.col + j * kLanes, left = n - col;
    const f32x16 b = bias ? load_n(bias + col, left) : f32x16{};
    for (int i = 0; i < R; ++i) store_n(f32x16(acc[i][j]) + b, y + i * n + col, left);
  }
}

using Tile = void (*)(const uint16_t*, const Panel&, const uint16_t*, uint16_t*, int64_t,
                      int64_t);

template <int B, bool Gated, int... R>
constexpr Tile pick(int rows, std::integer_sequence<int, R...>) {
  Tile t = nullptr;
  ((t = rows == R + 1 ? tile<R + 1, B, Gated> : t), ...);
  return t;
}

template <int... B>
Tile pick_blocks(int rows, int blocks, std::integer_sequence<int, B...>) {
  constexpr auto r = std::make_integer_sequence<int, kRows>{};
  Tile t = nullptr;
  ((t = blocks == B + 1 ? pick<B + 1, false>(rows, r) : t), ...);
  return t;
}

// The tile for rows <= kRows by blocks <= kBlocks (only those sizes are instantiated), or
// gated, by a gate block and its up block.
Tile tile_for(int rows, int blocks, bool gated) {
  if (gated) return pick<2, true>(rows, std::make_integer_sequence<int, kRows>{});
  return pick_blocks(rows, blocks, std::make_integer_sequence<int, kBlocks>{});
}
#endif
}  // namespace

// x [m, k], w pair-packed from [n, k] (k even), b [n] or null, y [m, n]; bfloat16, rows
// contiguous. Gated (see above; n a multiple of 32, no b): y [m, n / 2]. Returns nonzero
// where it has no kernel (no AVX512-BF16, k odd, a gated n or b it cannot take).
extern "C" int pdserve_pair_gemm(const void* x, const void* w, const void* b, void* y,
                                 int64_t m, int64_t n, int64_t k, int gated, int threads) {
#if defined(__AVX512BF16__)
  if (k % 2 || (gated && (n % (2 * kLanes) || b))) return 1;
  const auto* X = static_cast<const uint16_t*>(x);
  const auto* W = static_cast<const uint16_t*>(w);
  const auto* B = static_cast<const uint16_t*>(b);
  auto* Y = static_cast<uint16_t*>(y);
  const int64_t blocks = (n + kLanes - 1) / kLanes, stride = k / 2 * 32;
  // Each thread takes an equal run of blocks (of block pairs, gated), in panels of kBlocks
  // or fewer, whatever n: with panels of 4 blocks, dealing out whole ones left one of two
  // threads a panel more for o and down (9 panels each), 5 % of the products' time at 1 row.
  static_assert(kBlocks == 2, "a gated panel is one gate block and its up block");
  const int64_t unit = gated ? 2 : 1, units = blocks / unit;
  const int64_t tiles = (m + kRows - 1) / kRows;  // of rows, in each panel
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t end = units * (t + 1) / nt * unit;
    for (int64_t first = units * t / nt * unit; first < end; first += kBlocks) {
      const int64_t count = std::min<int64_t>(end - first, kBlocks);
      const int64_t after = std::min<int64_t>(end - first - count, kBlocks);
      Panel pn{W + first * stride, after > 0 ? W + (first + count) * stride : nullptr, after,
               first * kLanes, tiles, 0};
      for (int64_t i0 = 0; i0 < m; i0 += kRows, ++pn.phase) {
        const int rows = int(std::min<int64_t>(m - i0, kRows));
        tile_for(rows, int(count), gated)(X + i0 * k, pn, B, Y + i0 * (n / unit), n, k);
      }
    }
  }
  return 0;
#else
  (void)x, (void)w, (void)b, (void)y, (void)m, (void)n, (void)k, (void)gated, (void)threads;
  return 1;
#endif
}
