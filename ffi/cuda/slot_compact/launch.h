// Stable compaction of slot lists on the GPU: each row's non-negative entries moved to its front in
// their order, -1 after. The DSA backward's glue (jax_dsa/ops/sparse_mla/cuda.py) needs its lists
// valid-first; a block scan a row does it without an XLA sort or a host round trip.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dsa {

// out[r, :] = the entries >= 0 of in[r, :k_in] in order, then -1 up to k_out (k_out >= k_in).
// rows x k_in int32 in, rows x k_out int32 out, on `stream` (no allocation, no synchronisation).
cudaError_t LaunchCompactSlots(const int32_t* in, int32_t* out, int64_t rows, int64_t k_in,
                               int64_t k_out, cudaStream_t stream);

}  // namespace jax_dsa
