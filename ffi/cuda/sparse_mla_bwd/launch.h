// jax_dsa's own SM90 sparse-MLA backward (wgmma), plain C++ API on raw device pointers. Same
// contract as the cuDNN path (ffi/cuda/dsa_bwd/handler.cc, jax_dsa/ops/sparse_mla/cuda.py
// cuda_backward_rows); the math is jax_dsa/ops/sparse_mla/xla.py `backward`:
//
//   q [S_q, H, D] bf16 (H 64 or 128, D 576 or 512), kv [S_kv, D] bf16 (V = the first 512
//   columns), out / dout [S_q, H, 512] bf16, lse [S_q, H] fp32 natural-log sink-free (+inf: a row
//   without a valid slot), attn_sink [H] fp32 (-inf: no sink), indices [S_q, K] int32 (valid
//   slots a prefix of length topk_length[t] >= 1, values in [0, S_kv); slots past it are never
//   read; a value out of range counts as invalid), topk_length [S_q] int32, sm_scale.
//   Outputs: dq [S_q, H, D] bf16, dkv [S_kv, D] bf16 (dK over all D columns + dV over the first
//   512), d_attn_sink [H] fp32, and a workspace of SparseMlaBwdWorkspaceBytes(...) bytes.
//
// deterministic = false: dKV rows go into an fp32 accumulator with red.global.add.v4.f32.
// deterministic = true: bitwise identical outputs from run to run (partial rows stored in
//   (query, slot) order, a CSR by kv row from a stable radix sort, a fixed-order reduction;
//   kernels.cu's header comment has the details). dq and d_attn_sink are deterministic in both.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_dsa {
namespace sparse_mla_bwd {

constexpr int kDv = 512;

struct SparseMlaBwdParams {
  // Inputs.
  const void* q = nullptr;        // bf16 [s_q, h, d]
  const void* kv = nullptr;       // bf16 [s_kv, d]
  const void* out = nullptr;      // bf16 [s_q, h, 512]
  const void* dout = nullptr;     // bf16 [s_q, h, 512]
  const float* lse = nullptr;     // [s_q, h]
  const float* attn_sink = nullptr;  // [h]
  const int32_t* indices = nullptr;  // [s_q, k]
  const int32_t* topk_length = nullptr;  // [s_q]
  // Outputs.
  void* dq = nullptr;        // bf16 [s_q, h, d]
  void* dkv = nullptr;       // bf16 [s_kv, d]
  float* d_sink = nullptr;   // [h]
  void* workspace = nullptr;  // SparseMlaBwdWorkspaceBytes(...) bytes, 16-byte aligned
  size_t workspace_bytes = 0;
  // Dimensions.
  int64_t s_q = 0, s_kv = 0, h = 0, d = 0, k = 0;
  float sm_scale = 1.f;
  bool deterministic = false;
  // Deterministic mode: queries per chunk (0: automatic: the chunk's bf16 partial rows take at
  // most 2 GiB; unless it covers all s_q queries, a chunk of more than 132 is a multiple of 132,
  // whole waves of the 132 SMs of an H100 SXM or H200). The chunk fixes the summation order:
  // results repeat for a given chunk. Must be the value given to SparseMlaBwdWorkspaceBytes.
  int64_t chunk_queries = 0;
  // Atomic mode: queries a launch (0: automatic: one wave of one-CTA-an-SM queries a launch when
  // the fp32 dKV accumulator exceeds the L2 cache, else all in one launch). Speed only.
  int64_t wave_queries = 0;
};

// The chunk the deterministic mode uses for these sizes (chunk_queries 0: automatic).
int64_t SparseMlaBwdChunkQueries(int64_t s_q, int64_t d, int64_t k, int64_t chunk_queries);

// Workspace bytes for the call: arithmetic only (no CUDA runtime), mirrored by the JAX glue
// (jax_dsa/ops/sparse_mla/cuda.py own_backward_workspace_bytes). Returns 0 for unsupported
// dimensions (LaunchSparseMlaBwd then reports the error).
size_t SparseMlaBwdWorkspaceBytes(int64_t s_q, int64_t s_kv, int64_t h, int64_t d, int64_t k,
                                  bool deterministic, int64_t chunk_queries = 0);

// Enqueues the backward on `stream` (no allocation, no synchronisation). cudaErrorInvalidValue
// for unsupported H / D, bad sizes or a workspace that is too small.
cudaError_t LaunchSparseMlaBwd(const SparseMlaBwdParams& p, cudaStream_t stream);

}  // namespace sparse_mla_bwd
}  // namespace jax_dsa
