// Vector helpers shared by pdserve's CPU kernels: GCC vector extensions, so that
// -march=native picks the host's widest registers; bfloat16 handled as its raw bits.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace pdserve {

typedef float f32x16 __attribute__((vector_size(64)));
// Half vectors, for loops whose working set must fit AVX2's sixteen 8-float registers:
// there GCC splits each 16-float vector in two, spills halves past 16 and builds every
// scalar broadcast on the stack (a chunk's attention ran 7x slower than with these).
typedef float f32x8 __attribute__((vector_size(32)));
inline f32x8 load8(const float* p) { f32x8 v; std::memcpy(&v, p, sizeof v); return v; }
inline f32x8 load8(const uint16_t* p) {  // bfloat16 is the top half of a float32
  typedef uint16_t u16x8 __attribute__((vector_size(16)));
  typedef uint32_t u32x8 __attribute__((vector_size(32)));
  u16x8 h; std::memcpy(&h, p, sizeof h);
  const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f32x8 v; std::memcpy(&v, &w, sizeof v); return v;
}
inline f32x16 join(f32x8 lo, f32x8 hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline f32x8 half(const f32x16& x, int i) {  // lanes 8i .. 8i + 7
  f32x8 v; std::memcpy(&v, reinterpret_cast<const float*>(&x) + 8 * i, sizeof v); return v;
}
inline void set_half(f32x16& x, int i, f32x8 v) {
  std::memcpy(reinterpret_cast<float*>(&x) + 8 * i, &v, sizeof v);
}
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline f32x16 load(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof v); return v; }
inline f32x16 load(const uint16_t* p) {  // bfloat16 is the top half of a float32
  u16x16 h; std::memcpy(&h, p, sizeof h);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v; std::memcpy(&v, &w, sizeof v); return v;
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f; std::memcpy(&f, &u, sizeof f); return f;
}
typedef int32_t i32x16 __attribute__((vector_size(64)));

// Rounds x to T and back, as storing to T and loading would (in registers): bfloat16 to
// nearest even, NaN kept quiet.
template <typename T>
inline f32x16 round_to(f32x16 x);
template <>
inline f32x16 round_to<float>(f32x16 x) { return x; }
template <>
inline f32x16 round_to<uint16_t>(f32x16 x) {
  u32x16 u;
  std::memcpy(&u, &x, sizeof u);
  const u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const u32x16 quiet = (u & 0xffff0000u) | 0x400000u;
  u = (u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline void store(f32x16 v, float* o) { std::memcpy(o, &v, sizeof v); }
inline void store(f32x16 v, uint16_t* o) {
  u32x16 u;
  const f32x16 r = round_to<uint16_t>(v);
  std::memcpy(&u, &r, sizeof u);
  const u16x16 h = __builtin_convertvector(u >> 16, u16x16);
  std::memcpy(o, &h, sizeof h);
}

// The first m < 16 elements at p, the other lanes `pad`; and the first m lanes stored:
// a row's tail goes through the same vector code as its body.
template <typename T>
inline f32x16 load_partial(const T* p, int64_t m, float pad = 0.f) {
  T tmp[kLanes];
  store(f32x16{} + pad, tmp);
  std::memcpy(tmp, p, m * sizeof(T));
  return load(tmp);
}
template <typename T>
inline void store_partial(f32x16 v, T* o, int64_t m) {
  T tmp[kLanes];
  store(v, tmp);
  std::memcpy(o, tmp, m * sizeof(T));
}

// The next 16 of the m values left at p (all of them where fewer, the other lanes `pad`),
// and stored alike: a row's body and tail in one call.
template <typename T>
inline f32x16 load_n(const T* p, int64_t m, float pad = 0.f) {
  return m >= kLanes ? load(p) : load_partial(p, m, pad);
}
template <typename T>
inline void store_n(f32x16 v, T* o, int64_t m) {
  if (m >= kLanes) store(v, o); else store_partial(v, o, m);
}

// e^x for x up to 88.72 (or NaN), 2^n * e^r with |r| <= ln2/2 by a degree-7 Taylor
// polynomial (about 1 ulp), with no library call; below -87 it stays at e^-87. A softmax's
// shifted scores (<= 0) call it directly: they cannot overflow.
inline f32x16 exp_no_overflow(f32x16 x) {
  x = x < -87.f ? f32x16{} - 87.f : x;
  const f32x16 shifter = f32x16{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to integer
  const f32x16 n = (x * 1.44269504f + shifter) - shifter;
  const f32x16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  f32x16 p = f32x16{} + 1.f / 5040;
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// e^x: past 88.72, inf (as expf).
inline f32x16 exp_approx(f32x16 x) {
  const auto overflow = x > 88.72f;
  return overflow ? f32x16{} + INFINITY : exp_no_overflow(overflow ? f32x16{} : x);
}

// The MLP's SiLU-gated product, silu(gate) rounded to T (as HF's act_fn output is) times up,
// before its store rounds it: pdserve_silu_mul's and the fused product's epilogue alike.
template <typename T>
inline f32x16 silu_times(f32x16 gate, f32x16 up) {
  return round_to<T>(gate / (1.f + exp_approx(f32x16{} - gate))) * up;
}

inline float sum(f32x16 x) {  // a fixed tree, so every run adds in the same order
  typedef float f32x4 __attribute__((vector_size(16)));
  f32x8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

}  // namespace pdserve
