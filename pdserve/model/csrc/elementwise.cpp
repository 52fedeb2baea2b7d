// Row-wise RMSNorm and the SiLU-gated product of the MLP, one pass over memory each, where
// torch's bfloat16 ops take eight passes (the norm) and three (silu, multiply). Results are
// rounded where HF's formulas round: the normalised row to the input dtype before the
// weight, silu(gate) before the product.
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {
using namespace pdserve;

// f(i, m) for each run of m <= 16 elements from i, over [0, dim).
template <typename F>
inline void for_chunks(int64_t dim, F f) {
  for (int64_t i = 0; i < dim; i += kLanes) f(i, dim - i < kLanes ? dim - i : kLanes);
}

template <typename T>
inline f32x16 load_n(const T* p, int64_t m) { return m == kLanes ? load(p) : load_partial(p, m); }
template <typename T>
inline void store_n(f32x16 v, T* o, int64_t m) {
  if (m == kLanes) store(v, o); else store_partial(v, o, m);
}

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* o = out + r * dim;
    f32x16 acc = {};
    for_chunks(dim, [&](int64_t i, int64_t m) {
      const f32x16 v = load_n(xr + i, m);
      acc += v * v;
    });
    const float inv = 1.f / std::sqrt(sum(acc) / float(dim) + eps);
    for_chunks(dim, [&](int64_t i, int64_t m) {
      store_n(load_n(w + i, m) * round_to<T>(load_n(xr + i, m) * inv), o + i, m);
    });
  }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * dim;
    const T* u = g + dim;
    T* o = out + r * dim;
    for_chunks(dim, [&](int64_t i, int64_t m) {
      const f32x16 x = load_n(g + i, m);
      store_n(round_to<T>(x / (1.f + exp_approx(f32x16{} - x))) * load_n(u + i, m), o + i, m);
    });
  }
}

}  // namespace

// x, out: [rows, dim]; w: [dim]. out = w * dtype(x * rsqrt(mean(x^2) + eps)).
extern "C" void pdserve_rms_norm(int bf16, const void* x, const void* w, void* out,
                                 int64_t rows, int64_t dim, float eps, int threads) {
  if (bf16)
    rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
             static_cast<uint16_t*>(out), rows, dim, eps, threads);
  else
    rms_norm(static_cast<const float*>(x), static_cast<const float*>(w),
             static_cast<float*>(out), rows, dim, eps, threads);
}

// gate_up: [rows, 2 * dim] (gate, then up); out: [rows, dim] = dtype(silu(gate)) * up.
extern "C" void pdserve_silu_mul(int bf16, const void* gate_up, void* out, int64_t rows,
                                 int64_t dim, int threads) {
  if (bf16)
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, dim,
             threads);
  else
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, dim, threads);
}
