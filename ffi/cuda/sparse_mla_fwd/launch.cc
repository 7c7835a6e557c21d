// The SM90 sparse MLA forward's launch code (launch.h).
#include "cuda/sparse_mla_fwd/launch.h"

#include <atomic>
#include <mutex>

namespace jax_dsa {

const SparseMlaFwdKernel* FindFwd(int h, int d, bool contiguous, bool target) {
  for (int i = 0; i < kNumSparseMlaFwdKernels; ++i) {
    const SparseMlaFwdKernel& k = kSparseMlaFwdKernels[i];
    if (k.h == h && k.d == d && (k.contiguous != 0) == contiguous && (k.target != 0) == target)
      return &k;
  }
  return nullptr;
}

namespace {
std::once_flag g_fwd_load_once;
cudaError_t g_fwd_load_error = cudaSuccess;
}  // namespace

cudaError_t LoadFwdKernels() {
  std::call_once(g_fwd_load_once, [] {
    cudaGetLastError();
    for (int i = 0; i < kNumSparseMlaFwdKernels; ++i) kSparseMlaFwdKernels[i].load();
    g_fwd_load_error = cudaGetLastError();
  });
  return g_fwd_load_error;
}

int32_t NumSms() {
  static std::atomic<int32_t> cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 132;
  int32_t n = cached[dev].load(std::memory_order_relaxed);
  if (n > 0) return n;
  int m = 0;
  if (cudaDeviceGetAttribute(&m, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || m < 1)
    m = 132;
  cached[dev].store(m, std::memory_order_relaxed);
  return m;
}

cudaError_t LaunchFwd(const SparseMlaFwdKernel* kern, const SparseMlaFwdLaunch& a, std::string* what) {
  int32_t rc = kern->run(a);
  cudaError_t e = cudaGetLastError();
  if (rc != 0 || e != cudaSuccess) {
    *what = std::string("launching ") + kern->name + " (rc " + std::to_string(rc) + ")";
    return e != cudaSuccess ? e : cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace jax_dsa
