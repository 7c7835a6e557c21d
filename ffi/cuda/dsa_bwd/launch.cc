// The SM90 DSA backward's launch code (launch.h).
#include "cuda/dsa_bwd/launch.h"

#include <mutex>

namespace jax_dsa {

const DsaBwdKernel* FindBwd(const DsaBwdKernel* table, int n, int h, int d, int k) {
  for (int i = 0; i < n; ++i) {
    if ((h < 0 || table[i].h == h) && (d < 0 || table[i].d == d) && (k < 0 || table[i].topk == k))
      return &table[i];
  }
  return nullptr;
}

const DsaBwdKernel* FindMainBwd(int h, int d, int k) {
  const DsaBwdKernel* exact = FindBwd(kMainKernels, kNumMainKernels, h, d, k);
  return exact ? exact : FindBwd(kMainKernels, kNumMainKernels, h, d, 0);
}

namespace {
std::once_flag g_load_once;
cudaError_t g_load_error = cudaSuccess;
}  // namespace

cudaError_t LoadBwdKernels() {
  std::call_once(g_load_once, [] {
    cudaGetLastError();
    for (int i = 0; i < kNumPreKernels; ++i) kPreKernels[i].load();
    for (int i = 0; i < kNumMainKernels; ++i) kMainKernels[i].load();
    for (int i = 0; i < kNumPostKernels; ++i) kPostKernels[i].load();
    g_load_error = cudaGetLastError();
  });
  return g_load_error;
}

cudaError_t LaunchBwd(const DsaBwdLaunch& a, int h, const DsaBwdKernel* pre,
                      const DsaBwdKernel* main, const DsaBwdKernel* post, std::string* what) {
  // The main kernel atomically adds into the dKV accumulator, the preprocess into d_sink.
  if (cudaError_t e = cudaMemsetAsync(a.dkv_accum, 0, size_t(a.dkv_accum_n) * 4, a.stream); e != cudaSuccess) {
    *what = "zeroing the dKV accumulator";
    return e;
  }
  if (cudaError_t e = cudaMemsetAsync(a.d_sink, 0, size_t(h) * 4, a.stream); e != cudaSuccess) {
    *what = "zeroing d_attn_sink";
    return e;
  }
  for (const DsaBwdKernel* kern : {pre, main, post}) {
    int32_t rc = kern->run(a);
    cudaError_t e = cudaGetLastError();
    if (rc != 0 || e != cudaSuccess) {
      *what = std::string("launching ") + kern->name + " (rc " + std::to_string(rc) + ")";
      return e != cudaSuccess ? e : cudaErrorLaunchFailure;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_dsa
