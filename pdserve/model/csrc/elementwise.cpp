// Row-wise RMSNorm and the SiLU-gated product of the MLP, one pass over memory each, where
// torch's bfloat16 ops take eight passes (the norm) and three (silu, multiply). Results are
// rounded where HF's formulas round: the normalised row to the input dtype before the
// weight, silu(gate) before the product.
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {
using namespace pdserve;

template <typename T>
void rms_norm(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    T* o = out + r * dim;
    const int64_t whole = dim - dim % kLanes;
    f32x16 acc = {};
    for (int64_t i = 0; i < whole; i += kLanes) {
      const f32x16 v = load(xr + i);
      acc += v * v;
    }
    float squares = sum(acc);
    for (int64_t i = whole; i < dim; ++i) squares += to_float(xr[i]) * to_float(xr[i]);
    const float inv = 1.f / std::sqrt(squares / float(dim) + eps);
    for (int64_t i = 0; i < whole; i += kLanes)
      store(load(w + i) * round_to<T>(load(xr + i) * inv), o + i);
    for (int64_t i = whole; i < dim; ++i) {
      T normed;
      store(to_float(xr[i]) * inv, &normed);
      store(to_float(w[i]) * to_float(normed), o + i);
    }
  }
}

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * dim;
    const T* u = g + dim;
    T* o = out + r * dim;
    const int64_t whole = dim - dim % kLanes;
    for (int64_t i = 0; i < whole; i += kLanes) {
      const f32x16 x = load(g + i);
      store(round_to<T>(x / (1.f + exp_approx(f32x16{} - x))) * load(u + i), o + i);
    }
    for (int64_t i = whole; i < dim; ++i) {
      const float x = to_float(g[i]);
      T silu;
      store(x / (1.f + exp_approx(-x)), &silu);
      store(to_float(silu) * to_float(u[i]), o + i);
    }
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
