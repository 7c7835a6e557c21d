// Stable compaction of slot lists on the GPU: each row's non-negative entries moved to its front in
// their order, -1 after. The DSA backward's glue (jax_dsa/ops/sparse_mla/cuda.py) needs its lists
// valid-first; a block scan a row does it without an XLA sort or a host round trip.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dsa {

// The longest list that the row sort takes; longer ones are compacted without sorting.
constexpr int64_t kMaxSortSlots = 8192;

// out[r, :] = the entries >= 0 of in[r, :k_in], then -1 up to k_out (k_out >= k_in): in their
// order (key_bits 0), or ascending when key_bits > 0 and k_in <= kMaxSortSlots (every entry must
// be below 2^key_bits - 1, key_bits <= 32). rows x k_in int32 in, rows x k_out int32 out, on
// `stream` (no allocation, no synchronisation).
cudaError_t LaunchCompactSlots(const int32_t* in, int32_t* out, int64_t rows, int64_t k_in,
                               int64_t k_out, int key_bits, cudaStream_t stream);

}  // namespace jax_dsa
