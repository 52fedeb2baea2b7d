// Row-wise RMSNorm and the SiLU-gated product of the MLP, one pass over memory each, where
// torch's bfloat16 ops take eight passes (the norm) and three (silu, multiply); and RoPE with
// the K/V cache write, one call per layer for what took torch a dozen small ops. Results are
// rounded where HF's formulas round: the normalised row to the input dtype before the
// weight, silu(gate) before the product, each product and sum of the rotation.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {
using namespace pdserve;

// Elements from which a call splits over threads: a batch of 64 decodes already gains
// (rope_store 66 -> 47 us, rms_norm 20 -> 15 us on 2 Zen 4 cores); one token does not.
constexpr int64_t kParallelFrom = 1 << 13;

// f(i, m) for each run of m <= 16 elements from i, over [0, dim).
template <typename F>
inline void for_chunks(int64_t dim, F f) {
  for (int64_t i = 0; i < dim; i += kLanes) f(i, dim - i < kLanes ? dim - i : kLanes);
}

template <typename T>
void rms_norm(T* x, const T* add, const T* w, T* out, int64_t rows, int64_t dim, float eps,
              int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * dim;
    T* o = out + r * dim;
    if (add)  // the residual sum first, rounded as torch's add rounds it
      for_chunks(dim, [&](int64_t i, int64_t m) {
        store_n(load_n(xr + i, m) + load_n(add + r * dim + i, m), xr + i, m);
      });
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
#pragma omp parallel for num_threads(threads) if (rows * dim >= kParallelFrom)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * dim;
    const T* u = g + dim;
    T* o = out + r * dim;
    for_chunks(dim, [&](int64_t i, int64_t m) {
      store_n(silu_times<T>(load_n(g + i, m), load_n(u + i, m)), o + i, m);
    });
  }
}

// a * c + b * s, each product and the sum rounded to T as torch's ops round them (float32
// may fuse a product into the add: a rounding fewer than torch).
template <typename T>
inline f32x16 rotate(f32x16 a, f32x16 b, f32x16 c, f32x16 s) {
  return round_to<T>(round_to<T>(a * c) + round_to<T>(b * s));
}

struct CacheSlots {  // element strides of the cache from one layer's K of block 0
  int64_t block, kv, token, head;
};

template <typename T>
void rope_store(T* qkv, const T* cos, const T* sin, int64_t tokens, int64_t heads,
                int64_t kv_heads, int64_t dim, int64_t rot, T* k0, const int64_t* blocks,
                const int64_t* offsets, CacheSlots s, int threads) {
  const int64_t half = rot / 2, width = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for num_threads(threads) if (tokens * width >= kParallelFrom)
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = qkv + t * width;
    const T* c = cos + t * rot;
    const T* sn = sin + t * rot;
    for (int64_t r = 0; r < heads + kv_heads; ++r) {  // q heads, then k heads
      T* x = row + r * dim;
      for_chunks(half, [&](int64_t i, int64_t m) {  // x = x * cos + roll(x, half) * sin
        const f32x16 lo = load_n(x + i, m), hi = load_n(x + half + i, m);
        store_n(rotate<T>(lo, hi, load_n(c + i, m), load_n(sn + i, m)), x + i, m);
        store_n(rotate<T>(hi, lo, load_n(c + half + i, m), load_n(sn + half + i, m)),
                x + half + i, m);
      });
    }
    T* slot = k0 + blocks[t] * s.block + offsets[t] * s.token;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(slot + h * s.head, row + (heads + h) * dim, dim * sizeof(T));
      std::memcpy(slot + s.kv + h * s.head, row + (heads + kv_heads + h) * dim,
                  dim * sizeof(T));
    }
  }
}

}  // namespace

// x, out: [rows, dim]; w: [dim]. out = w * dtype(x * rsqrt(mean(x^2) + eps)). With `add`
// ([rows, dim], else null), x += add first, in place: the residual sum and the next norm in
// one call.
extern "C" void pdserve_rms_norm(int bf16, void* x, const void* add, const void* w, void* out,
                                 int64_t rows, int64_t dim, float eps, int threads) {
  if (bf16)
    rms_norm(static_cast<uint16_t*>(x), static_cast<const uint16_t*>(add),
             static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), rows, dim, eps,
             threads);
  else
    rms_norm(static_cast<float*>(x), static_cast<const float*>(add),
             static_cast<const float*>(w), static_cast<float*>(out), rows, dim, eps, threads);
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

// qkv: [tokens, (heads + 2 * kv_heads) * dim], the first `rot` dims of each q and k head
// rotated in place (the rest pass: partial RoPE); cos, sin: [tokens, rot]; k0: the cache at
// one layer's K of block 0; token t's K/V go to block blocks[t], slot offsets[t]. Strides in
// elements.
extern "C" void pdserve_rope_store(int bf16, void* qkv, const void* cos, const void* sin,
                                   int64_t tokens, int64_t heads, int64_t kv_heads,
                                   int64_t dim, int64_t rot, void* k0,
                                   const int64_t* blocks,
                                   const int64_t* offsets, int64_t s_block, int64_t s_kv,
                                   int64_t s_token, int64_t s_head, int threads) {
  const CacheSlots s{s_block, s_kv, s_token, s_head};
  if (bf16)
    rope_store(static_cast<uint16_t*>(qkv), static_cast<const uint16_t*>(cos),
               static_cast<const uint16_t*>(sin), tokens, heads, kv_heads, dim,
               rot, static_cast<uint16_t*>(k0), blocks, offsets, s, threads);
  else
    rope_store(static_cast<float*>(qkv), static_cast<const float*>(cos),
               static_cast<const float*>(sin), tokens, heads, kv_heads, dim,
               rot, static_cast<float*>(k0), blocks, offsets, s, threads);
}
