// Benchmark-only entry of the SM90 sparse MLA forward (benchmarks/ops/sparse_mla_fwd.py loads it
// with ctypes from libjax_dsa_cuda_bench.so, or benchmarks/tools/sparse_mla_fwd_variants.py from
// a benchmarks/tools/build_fwd_variant.sh library): the kernel launched from raw device pointers
// on a private stream, without XLA. Kept out of the production module.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/sparse_mla_fwd/launch.h"

// CUDA-event time of each of `iters` launches into ms_events. max_ctas > 0 caps the persistent
// grid (tests use it to make each CTA walk many tiles). Returns 0, or a CUDA error code
// (negative: no such variant or K not a multiple of kSparseMlaFwdKMultiple / launch failure).
extern "C" __attribute__((visibility("default"))) int jax_dsa_sparse_mla_fwd_raw_bench(
    const void* q, const void* kv, const int32_t* indices, const int32_t* topk_length,
    const float* attn_sink, void* out, float* lse, float* max_logits, int s_q, int s_kv, int h,
    int d, int k, float sm_scale, int iters, int max_ctas, float* ms_events) {
  using namespace jax_dsa;
  const SparseMlaFwdKernel* kern = FindFwd(h, d);
  if (!kern || k % kSparseMlaFwdKMultiple != 0) return -1;
  if (cudaError_t e = LoadFwdKernels(); e != cudaSuccess) return int(e);
  cudaStream_t stream;
  cudaEvent_t e0, e1;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) return int(e);
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  SparseMlaFwdLaunch a{q, kv, indices, topk_length, attn_sink, out, lse, max_logits, s_q, s_kv, k,
                       sm_scale, stream, max_ctas > 0 ? std::min(NumSms(), max_ctas) : NumSms()};
  int rc = 0;
  std::string what;
  for (int i = 0; i < iters && rc == 0; ++i) {
    cudaEventRecord(e0, stream);
    if (LaunchFwd(kern, a, &what) != cudaSuccess) rc = -2;
    cudaEventRecord(e1, stream);
    if (cudaError_t e = cudaEventSynchronize(e1); e != cudaSuccess) rc = int(e);
    cudaEventElapsedTime(&ms_events[i], e0, e1);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  return rc;
}
