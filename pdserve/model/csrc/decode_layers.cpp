// A decode step's decoder layers in one call: per layer the RMSNorm (with the residual sum),
// the q/k/v product, RoPE with the cache write, paged attention, the o product, the second
// norm, the SiLU-gated gate/up product and the down product. These are the kernels that
// LlamaModel.forward calls one by one from Python, called here in its order with its
// arguments, so a step's numbers are the same bits. Python between a step's 240 calls took
// 1.3-2.5 ms of a 10-40 ms step (SmolLM2, 2 Zen 5 cores), the other core idle meanwhile.
#include <cstdint>

extern "C" {  // the kernels, from the other sources of this library
void pdserve_rms_norm(int bf16, void* x, const void* add, const void* w, void* out,
                      int64_t rows, int64_t dim, float eps, int threads);
int pdserve_pair_gemm(const void* x, const void* w, const void* b, void* y, int64_t m,
                      int64_t n, int64_t k, int gated, int threads);
void pdserve_rope_store(int bf16, void* qkv, const void* cos, const void* sin, int64_t tokens,
                        int64_t heads, int64_t kv_heads, int64_t dim, int64_t rot, void* k0,
                        const int64_t* blocks, const int64_t* offsets, int64_t s_block,
                        int64_t s_kv, int64_t s_token, int64_t s_head, int threads);
int pdserve_paged_decode(int bf16, const void* q, int64_t q_stride, void* out,
                         int64_t out_stride, const int64_t* rows, const void* k0,
                         const int64_t* tables, const int64_t* lens, int64_t seqs,
                         int64_t width, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t block_size, int64_t s_block, int64_t s_kv, int64_t s_token,
                         int64_t s_head, float scale, float cap, int64_t window, int threads);
}

namespace {

struct Layer {  // a layer's norms and pair-packed weights (bf16), its attention's scores
  const void *ln1, *qkv, *o, *ln2, *gate_up, *down;
  float scale, cap;
  int64_t window;
};

struct Step {  // one step of `rows` decodes, all bf16
  void* h;  // [rows, hidden] the residual stream, in place
  void* delta;  // [rows, hidden] each attention's and MLP's output, summed into h by the next norm
  void *x, *qkv, *attn, *act;  // scratch: normed rows, q/k/v, attention, the MLP's activation
  const void *cos, *sin;  // [rows, rot] each row's RoPE
  const int64_t *slot_blocks, *slot_offsets;  // where each row's K/V goes
  const int64_t *index, *tables, *lens;  // decode i: its row, block table and context
  void* k0;  // the cache at layer 0's K of block 0
  int64_t rows, hidden, heads, kv_heads, dim, intermediate, rot, width, block_size;
  int64_t s_layer, s_block, s_kv, s_token, s_head;  // cache strides, in elements
  float eps;
  int32_t threads;
};

// Layer l of the step. Returns a kernel's refusal (nonzero) or 0.
int layer(const Step& s, const Layer& w, int64_t l) {
  const int t = s.threads;
  const int64_t q = s.heads * s.dim, qkv = (s.heads + 2 * s.kv_heads) * s.dim;
  void* k0 = static_cast<uint16_t*>(s.k0) + l * s.s_layer;
  pdserve_rms_norm(1, s.h, l ? s.delta : nullptr, w.ln1, s.x, s.rows, s.hidden, s.eps, t);
  if (int rc = pdserve_pair_gemm(s.x, w.qkv, nullptr, s.qkv, s.rows, qkv, s.hidden, 0, t))
    return rc;
  pdserve_rope_store(1, s.qkv, s.cos, s.sin, s.rows, s.heads, s.kv_heads, s.dim, s.rot, k0,
                     s.slot_blocks, s.slot_offsets, s.s_block, s.s_kv, s.s_token, s.s_head, t);
  if (int rc = pdserve_paged_decode(1, s.qkv, qkv, s.attn, q, s.index, k0, s.tables, s.lens,
                                    s.rows, s.width, s.heads, s.kv_heads, s.dim, s.block_size,
                                    s.s_block, s.s_kv, s.s_token, s.s_head, w.scale, w.cap,
                                    w.window, t))
    return rc;
  if (int rc = pdserve_pair_gemm(s.attn, w.o, nullptr, s.delta, s.rows, s.hidden, q, 0, t))
    return rc;
  pdserve_rms_norm(1, s.h, s.delta, w.ln2, s.x, s.rows, s.hidden, s.eps, t);
  if (int rc = pdserve_pair_gemm(s.x, w.gate_up, nullptr, s.act, s.rows, 2 * s.intermediate,
                                 s.hidden, 1, t))
    return rc;
  return pdserve_pair_gemm(s.act, w.down, nullptr, s.delta, s.rows, s.hidden, s.intermediate,
                           0, t);
}

}  // namespace

// Layers [first, last) of `layers` over the step. Returns 1, having changed nothing, where
// this CPU's build has no bf16 pairs kernel; 2 if a kernel refused midway (a caller's bug).
extern "C" int pdserve_decode_layers(const Step* step, const Layer* layers, int64_t first,
                                     int64_t last) {
#if defined(__AVX512BF16__)
  for (int64_t l = first; l < last; ++l)
    if (layer(*step, layers[l], l)) return 2;
  return 0;
#else
  return 1;
#endif
}
