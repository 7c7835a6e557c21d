// Interface of the generated dispatch table (sparse_mla_fwd_variants.cc, written by
// ffi/cuda/export/export_sparse_mla_fwd.py): jax_dsa's own SM90 sparse MLA forward, exported ahead
// of time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dsa {

// One forward launch on flat tokens (batch folded by the caller).
struct SparseMlaFwdLaunch {
  const void* q;              // [S_q, H, D] bf16
  const void* kv;             // [S_kv, D] bf16
  const int32_t* indices;     // [S_q, K]
  const int32_t* topk_length; // [S_q]
  const float* attn_sink;     // [H], -inf for none
  void* out;                  // [S_q, H, 512] bf16
  float* lse;                 // [S_q, H]
  float* max_logits;          // [S_q, H]
  int32_t s_q, s_kv, topk;
  float sm_scale;
  cudaStream_t stream;
  int32_t num_ctas;           // persistent grid: at most this many CTAs (the SM count)
  // target mode: out is the float32 mass [out_rows = S_q * H / 64, out_cols] and lse an input
  int32_t out_rows = 0, out_cols = 0;
};

struct SparseMlaFwdKernel {
  int h, d;
  int contiguous;  // 1: dense mode (slots = the run indices[s, 0] + j, j < topk_length[s])
  int target;      // 1: the indexer loss's target (mass from a given lse) instead of attention
  const char* name;
  void (*load)();
  int32_t (*run)(const SparseMlaFwdLaunch&);
};

extern const SparseMlaFwdKernel kSparseMlaFwdKernels[];
extern const int kNumSparseMlaFwdKernels;
// From jax_dsa/kernel_spec.py at build time: d_v of every variant, the multiple K must be, and
// the variants in words (for the handler's messages).
extern const int kSparseMlaFwdDv;
extern const int kSparseMlaFwdKMultiple;
extern const char kSparseMlaFwdSupported[];

}  // namespace jax_dsa
