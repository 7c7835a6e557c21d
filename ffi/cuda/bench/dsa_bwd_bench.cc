// Benchmark-only entry of the SM90 DSA backward (benchmarks/ops/dsa_bwd.py loads it with ctypes
// from libjax_dsa_cuda_bench.so): the kernels of the _cuda module, launched from raw device
// pointers on a private stream, without XLA. Kept out of the production module.

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "cuda/dsa_bwd/launch.h"

// Per iteration: CUDA-event time and host wall time of launch + stream synchronisation.
// Returns 0, or a CUDA error code (-1: no such variant, -2: a launch failed).
extern "C" __attribute__((visibility("default"))) int jax_dsa_dsa_bwd_raw_bench(
    const void* q, const void* kv, const void* out, const void* dout, const float* lse,
    const float* attn_sink, const int32_t* indices, const int32_t* topk_length, void* dq,
    void* dkv, float* d_sink, void* workspace, int s_q, int s_kv, int h, int d, int k,
    float sm_scale, int iters, float* ms_events, double* ms_wall) {
  using namespace jax_dsa;
  const DsaBwdKernel* pre = FindBwd(kPreKernels, kNumPreKernels, h, -1, -1);
  const DsaBwdKernel* post = FindBwd(kPostKernels, kNumPostKernels, -1, d, -1);
  // k < 0: the wide variant for -k slots, to time it against the bucket of the same width
  const DsaBwdKernel* main = k < 0 ? FindBwd(kMainKernels, kNumMainKernels, h, d, 0)
                                   : FindMainBwd(h, d, k);
  if (k < 0) k = -k;
  if (!pre || !post || !main) return -1;
  if (cudaError_t e = LoadBwdKernels(); e != cudaSuccess) return int(e);
  char* ws = static_cast<char*>(workspace);
  DsaBwdLaunch a{q, kv, out, dout, lse, attn_sink, indices, topk_length, dq, dkv, d_sink,
                 reinterpret_cast<float*>(ws), reinterpret_cast<float*>(ws + StatsBytes(s_q, h)),
                 reinterpret_cast<float*>(ws + 2 * StatsBytes(s_q, h)), s_q, s_kv,
                 int32_t(RoundUp(s_q, kBwdTileM)), int32_t(AccumElems(s_kv, d)), sm_scale, nullptr, k};
  cudaStream_t stream;
  cudaEvent_t e0, e1;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) return int(e);
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  a.stream = stream;
  int rc = 0;
  std::string what;
  for (int i = 0; i < iters && rc == 0; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    cudaEventRecord(e0, stream);
    if (LaunchBwd(a, h, pre, main, post, &what) != cudaSuccess) rc = -2;
    cudaEventRecord(e1, stream);
    cudaError_t e = cudaStreamSynchronize(stream);
    auto t1 = std::chrono::steady_clock::now();
    if (e != cudaSuccess) rc = int(e);
    cudaEventElapsedTime(&ms_events[i], e0, e1);
    ms_wall[i] = std::chrono::duration<double, std::milli>(t1 - t0).count();
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(stream);
  return rc;
}
