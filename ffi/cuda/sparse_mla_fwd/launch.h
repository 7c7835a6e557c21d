// The SM90 sparse MLA forward on raw device pointers: dispatch, module loading, the persistent
// grid and the launch. Shared by the XLA FFI handlers (handler.cc) and the benchmark-only
// library (ffi/cuda/bench/sparse_mla_fwd_bench.cc); no XLA or Python here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/sparse_mla_fwd/variants.h"

namespace jax_dsa {

// The compiled variant for (h, d) in slot-list or contiguous (dense) mode, attention or the
// indexer loss's target, or nullptr.
const SparseMlaFwdKernel* FindFwd(int h, int d, bool contiguous = false, bool target = false);

// Loads every kernel module, once per process (later calls return the first call's result).
cudaError_t LoadFwdKernels();

// The persistent kernel's grid: the current device's SM count, queried once per device.
int32_t NumSms();

// One launch on a.stream. Returns cudaSuccess, or the error with the failed step in *what.
cudaError_t LaunchFwd(const SparseMlaFwdKernel* kern, const SparseMlaFwdLaunch& a, std::string* what);

}  // namespace jax_dsa
