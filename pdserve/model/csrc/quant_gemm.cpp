// Products with int8 or int4 weights, computed in integers: y = sum over groups g of 32
// inputs of (qx_g qw_g^T) * (sx_g * sw_g), plus b. GGUF's Q8_0 and Q4_0 weights against Q8_0
// rows of x, as llama.cpp multiplies them. int4 weights may carry a min per group as well
// (GGUF's Q4_1, and Q4_K's sub-blocks): w = q * sw + mw with q within 0..15, and then
// y = sum over g of ((qx_g q_g^T) * sw_g + (sum qx_g) * mw_g) * sx_g.
//
// The weight w [n, k] comes in groups of 32 inputs, each with a quant per weight (int8 within
// +-127, or int4 within -8..7) and a float16 scale per output. Quants are "octet-packed": for
// each block of 8 outputs and each octet of inputs (8o .. 8o+7), 64 bytes (int8: the 8
// outputs' quants of 8o .. 8o+3 side by side, 4 each, then those of 8o+4 .. 8o+7) or 32
// (int4: byte 4j + i holds output j's quant of 8o+i in its low half and of 8o+4+i in its high
// half, each plus 8), [ceil(n/8)][k/8][64 or 32] bytes (k a multiple of 32; zeros pad n).
// Scales (and mins) are [ceil(n/8)][k/32][8]. Each row of x is quantized as it comes, in groups of 32
// (sx = max|x| / 127), so a row's result does not depend on the rows beside it: the integer
// sums are exact and the float sums run over the groups in order, the same in any batch.
//
// With AVX2 one 32-byte vector of quants serves 8 outputs times 4 inputs: the row's quad is
// broadcast, vpmaddubsw multiplies unsigned by signed bytes and adds pairs in 16 bits, and
// vpmaddwd sums those into 32-bit lanes; no step saturates (group_sums says why, for each
// width). A tile is up to 2 rows by 2 blocks; each thread takes an equal run of blocks. Without AVX2 (and F16C) the function returns nonzero
// and the caller computes the same numbers in torch (quant.reference).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "vec.h"
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#include <omp.h>
#endif

namespace {
using pdserve::to_float;
constexpr int kGroup = 32;

uint16_t float_to_bf16(float f) {  // to nearest even, NaN kept quiet (as torch rounds)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A row of x quantized in groups of 32 into q, their scales into s and the sums of their
// quants into t (int4 products need them, below): the steps of
// quant.quantize_groups, amax / 127 and x * (127 / amax) rounded to nearest even (adding and
// taking away 1.5 * 2^23 rounds a float within +-2^22 so, as nearbyint does, in registers;
// the product rounded first, as torch's is: no fused multiply-add).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void quantize_row(const T* x, int64_t k, int8_t* q,
                                                                float* s, int32_t* t) {
  using pdserve::f32x16;
  typedef int32_t i32x16 __attribute__((vector_size(64)));
  typedef int8_t i8x16 __attribute__((vector_size(16)));
  const f32x16 magic = f32x16{} + 12582912.f;
  for (int64_t g = 0; g < k; g += kGroup) {
    const f32x16 lo = pdserve::load(x + g), hi = pdserve::load(x + g + 16);
    const f32x16 alo = lo < 0 ? -lo : lo, ahi = hi < 0 ? -hi : hi;
    const f32x16 a = alo > ahi ? alo : ahi;
    float amax = 0.f;
    for (int j = 0; j < 16; ++j) amax = std::max(amax, a[j]);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const i32x16 ilo = __builtin_convertvector((lo * inv + magic) - magic, i32x16);
    const i32x16 ihi = __builtin_convertvector((hi * inv + magic) - magic, i32x16);
    const i8x16 qlo = __builtin_convertvector(ilo, i8x16), qhi = __builtin_convertvector(ihi, i8x16);
    std::memcpy(q + g, &qlo, 16);
    std::memcpy(q + g + 16, &qhi, 16);
    s[g / kGroup] = amax / 127.f;
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += ilo[j] + ihi[j];
    t[g / kGroup] = sum;
  }
}

#if defined(__AVX2__) && defined(__F16C__)
constexpr int kRows = 2, kBlocks = 2, kLanes = 8;  // 16 ymm registers: 2 x 2 sums and accumulators

struct Rows {  // a tile's rows of x, quantized
  const int8_t* q;
  const float* s;    // [rows][k / 32]
  const int32_t* t;  // [rows][k / 32]: each group's sum of quants
};

inline int32_t load_quad(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof quad);
  return quad;
}

struct Out {  // where a tile's sums go
  const void* b;  // bias [n] in y's type, or null
  void* y;
  int64_t n;
  bool bf16;
};

// sums += x's quad (4 int8 at x) times w's 8 outputs by 4 int8 inputs: |x| times w carrying
// x's sign, so that vpmaddubsw's unsigned side is x's.
inline __m256i dot_quad(__m256i sums, const int8_t* x, __m256i w) {
  const __m256i xq = _mm256_set1_epi32(load_quad(x));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(xq), _mm256_sign_epi8(w, xq));
  return _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// The integer sums of a group of 32 inputs for R rows by B blocks of 8 outputs.
// int8: quads of quants signed, 32-bit sums per quad. int4: the quants' unsigned nibbles
// (q + 8, 0..15) are vpmaddubsw's unsigned side and x its signed one, so no sign trick is
// needed; a pair's sum is within 2 * 15 * 127, so the group's 8 quads add up in 16 bits
// (within 30,480), and sum (q - 8) x = sum (q + 8 - 8) x comes out as that minus 8 sum x
// (with Mins the nibbles are the quants themselves: no offset).
template <int Bits, bool Mins, int R, int B>
inline void group_sums(const Rows& x, int64_t k, const int8_t* wq, int64_t stride, int64_t g,
                       __m256i (&sums)[R][B]) {
  if constexpr (Bits == 8) {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < B; ++j) sums[i][j] = _mm256_setzero_si256();
    for (int64_t q = g * kGroup / 4; q < (g + 1) * kGroup / 4; ++q)
      for (int j = 0; j < B; ++j) {
        const __m256i w = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wq + j * stride + q * 32));
        for (int i = 0; i < R; ++i) sums[i][j] = dot_quad(sums[i][j], x.q + i * k + 4 * q, w);
      }
  } else {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i pairs[R][B];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < B; ++j) pairs[i][j] = _mm256_setzero_si256();
    for (int64_t o = g * kGroup / 8; o < (g + 1) * kGroup / 8; ++o)
      for (int j = 0; j < B; ++j) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wq + j * stride + o * 32));
        const __m256i a = _mm256_and_si256(v, low);
        const __m256i b = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < R; ++i) {
          const int8_t* xo = x.q + i * k + 8 * o;
          pairs[i][j] = _mm256_add_epi16(pairs[i][j], _mm256_add_epi16(
              _mm256_maddubs_epi16(a, _mm256_set1_epi32(load_quad(xo))),
              _mm256_maddubs_epi16(b, _mm256_set1_epi32(load_quad(xo + 4)))));
        }
      }
    for (int i = 0; i < R; ++i) {
      const __m256i offset = _mm256_set1_epi32(Mins ? 0 : 8 * x.t[i * (k / kGroup) + g]);
      for (int j = 0; j < B; ++j)
        sums[i][j] = _mm256_sub_epi32(_mm256_madd_epi16(pairs[i][j], _mm256_set1_epi16(1)),
                                      offset);
    }
  }
}

inline __m256 halfs(const uint16_t* p) {  // 8 float16 as float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int Bits, bool Mins, int R, int B>
void tile(Rows x, int64_t k, const int8_t* wq, const uint16_t* ws, const uint16_t* wm,
          int64_t col, const Out& o) {
  const int64_t groups = k / kGroup, stride = k * kLanes * Bits / 8, sstride = groups * kLanes;
  __m256 acc[R][B];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < B; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sums[R][B];
    group_sums<Bits, Mins>(x, k, wq, stride, g, sums);
    for (int j = 0; j < B; ++j) {
      const __m256 sw = halfs(ws + j * sstride + g * kLanes);
      for (int i = 0; i < R; ++i) {
        const __m256 sx = _mm256_set1_ps(x.s[i * groups + g]);
        __m256 part;
        if constexpr (Mins) {
          __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[i][j]), sw);
          __m256 offset = _mm256_mul_ps(_mm256_set1_ps(float(x.t[i * groups + g])),
                                        halfs(wm + j * sstride + g * kLanes));
          asm("" : "+x"(scaled), "+x"(offset));  // each rounded, as torch's steps
          part = _mm256_mul_ps(_mm256_add_ps(scaled, offset), sx);
        } else {
          part = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[i][j]), _mm256_mul_ps(sx, sw));
        }
        asm("" : "+x"(part));  // rounded before the sum, as torch's steps: no fused add
        acc[i][j] = _mm256_add_ps(acc[i][j], part);
      }
    }
  }
  for (int j = 0; j < B; ++j) {
    const int64_t c0 = col + j * kLanes, width = std::min<int64_t>(kLanes, o.n - c0);
    for (int i = 0; i < R; ++i) {
      float v[kLanes];
      _mm256_storeu_ps(v, acc[i][j]);
      for (int64_t l = 0; l < width; ++l) {
        const int64_t c = c0 + l;
        if (o.bf16) {
          const float b = o.b ? to_float(static_cast<const uint16_t*>(o.b)[c]) : 0.f;
          static_cast<uint16_t*>(o.y)[i * o.n + c] = float_to_bf16(o.b ? v[l] + b : v[l]);
        } else {
          const float* b = static_cast<const float*>(o.b);
          static_cast<float*>(o.y)[i * o.n + c] = b ? v[l] + b[c] : v[l];
        }
      }
    }
  }
}

using Tile = void (*)(Rows, int64_t, const int8_t*, const uint16_t*, const uint16_t*, int64_t,
                      const Out&);

template <int Bits, bool Mins, int B, int... R>
Tile pick(int rows, std::integer_sequence<int, R...>) {
  Tile t = nullptr;
  ((t = rows == R + 1 ? tile<Bits, Mins, R + 1, B> : t), ...);
  return t;
}

template <int Bits, bool Mins>
Tile tile_for(int rows, int blocks) {
  constexpr auto r = std::make_integer_sequence<int, kRows>{};
  return blocks == kBlocks ? pick<Bits, Mins, kBlocks>(rows, r) : pick<Bits, Mins, 1>(rows, r);
}
#endif
}  // namespace

// x [m, k] (bfloat16 if bf16, else float32; rows contiguous; k a multiple of 32), wq (of
// `bits` 8 or 4), ws and wm (int4's mins, or null) octet-packed from [n, k] (above), b [n] in
// x's type or null, y [m, n] in x's type. Returns nonzero where it has no kernel (no AVX2 and
// F16C, k not a multiple of 32, other bits, mins with 8 bits).
extern "C" int pdserve_quant_gemm(int bits, int bf16, const void* x, const void* wq,
                                  const void* ws, const void* wm, const void* b, void* y,
                                  int64_t m, int64_t n, int64_t k, int threads) {
#if defined(__AVX2__) && defined(__F16C__)
  if (k % kGroup || (bits != 8 && bits != 4) || (wm && bits != 4)) return 1;
  const int64_t blocks = (n + kLanes - 1) / kLanes, groups = k / kGroup;
  std::vector<int8_t> qx(m * k);
  std::vector<float> sx(m * groups);
  std::vector<int32_t> tx(m * groups);
#pragma omp parallel for num_threads(threads)
  for (int64_t i = 0; i < m; ++i) {
    if (bf16)
      quantize_row(static_cast<const uint16_t*>(x) + i * k, k, &qx[i * k], &sx[i * groups],
                   &tx[i * groups]);
    else
      quantize_row(static_cast<const float*>(x) + i * k, k, &qx[i * k], &sx[i * groups],
                   &tx[i * groups]);
  }
  const auto* Q = static_cast<const int8_t*>(wq);
  const auto* S = static_cast<const uint16_t*>(ws);
  const auto* M = static_cast<const uint16_t*>(wm);
  Tile (*const tiles)(int, int) = bits == 8 ? tile_for<8, false>
                                  : M ? tile_for<4, true> : tile_for<4, false>;
  const int64_t esize = bf16 ? 2 : 4;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t end = blocks * (t + 1) / nt;
    for (int64_t first = blocks * t / nt; first < end; first += kBlocks) {
      const int count = int(std::min<int64_t>(end - first, kBlocks));
      for (int64_t i0 = 0; i0 < m; i0 += kRows) {
        const int rows = int(std::min<int64_t>(m - i0, kRows));
        const Out o{b, static_cast<char*>(y) + i0 * n * esize, n, bool(bf16)};
        tiles(rows, count)(Rows{&qx[i0 * k], &sx[i0 * groups], &tx[i0 * groups]}, k,
                           Q + first * k * kLanes * bits / 8, S + first * groups * kLanes,
                           M ? M + first * groups * kLanes : nullptr, first * kLanes, o);
      }
    }
  }
  return 0;
#else
  (void)bits, (void)bf16, (void)x, (void)wq, (void)ws, (void)wm, (void)b, (void)y, (void)m, (void)n,
      (void)k, (void)threads;
  return 1;
#endif
}
