// Interface of the generated dispatch table (dsa_bwd_variants.cc, written by
// ffi/cuda/export/export_dsa_bwd.py): the cuDNN frontend's SM90 DSA backward kernels, exported
// ahead of time with CuTe DSL.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dsa {

// Everything one backward needs; the tensors are flat tokens (batch folded by the caller).
struct DsaBwdLaunch {
  const void* q;            // [S_q, H, D] bf16
  const void* kv;           // [S_kv, D] bf16
  const void* out;          // [S_q, H, 512] bf16
  const void* dout;         // [S_q, H, 512] bf16
  const float* lse;         // [S_q, H] natural log, sink-free
  const float* attn_sink;   // [H]
  const int32_t* indices;   // [S_q, K] global rows, valid prefix then -1
  const int32_t* topk_length;  // [S_q], >= 1
  void* dq;                 // [S_q, H, D] bf16
  void* dkv;                // [S_kv, D] bf16
  float* d_sink;            // [H]
  float* dpsum;             // workspace: [round64(S_q), H]
  float* lse_log2;          // workspace: [round64(S_q), H]
  float* dkv_accum;         // workspace: [round64(S_kv) * round32(D)]
  int32_t s_q, s_kv, s_q_rounded, dkv_accum_n;
  float sm_scale;
  cudaStream_t stream;
  int32_t topk = 0;         // K, the index row stride (read by the wide variant only)
};

struct DsaBwdKernel {
  int h, d, topk;  // the key: pre uses h, post d, main all three (topk 0: the wide variant)
  const char* name;
  void (*load)();
  int32_t (*run)(const DsaBwdLaunch&);
};

extern const DsaBwdKernel kPreKernels[];
extern const int kNumPreKernels;
extern const DsaBwdKernel kMainKernels[];
extern const int kNumMainKernels;
extern const DsaBwdKernel kPostKernels[];
extern const int kNumPostKernels;
// From jax_dsa/kernel_spec.py at build time: d_v of every variant, and the variants in words
// (for the handler's messages).
extern const int kDsaBwdDv;
extern const char kDsaBwdSupported[];

}  // namespace jax_dsa
