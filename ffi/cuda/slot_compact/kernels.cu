// Stable compaction of slot lists (launch.h): one CTA a row, CUB's block scan over tiles of
// 2048 slots (8 consecutive slots a thread, so that a thread's order is the list's order).
#include "cuda/slot_compact/launch.h"

#include <cub/block/block_scan.cuh>

namespace jax_dsa {
namespace {

constexpr int kThreads = 256, kItems = 8, kTile = kThreads * kItems;

__global__ void __launch_bounds__(kThreads) CompactSlotsKernel(const int32_t* __restrict__ in,
                                                               int32_t* __restrict__ out, int k_in,
                                                               int k_out) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int32_t* src = in + int64_t(blockIdx.x) * k_in;
  int32_t* dst = out + int64_t(blockIdx.x) * k_out;
  int base = 0;  // valid slots written by the earlier tiles
  for (int t0 = 0; t0 < k_in; t0 += kTile) {
    int v[kItems], n = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = t0 + threadIdx.x * kItems + j;
      v[j] = i < k_in ? __ldg(src + i) : -1;
      n += v[j] >= 0;
    }
    int at, total;
    Scan(scan).ExclusiveSum(n, at, total);
    at += base;
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (v[j] >= 0) dst[at++] = v[j];
    base += total;
    __syncthreads();  // the scan's storage is reused by the next tile
  }
  for (int i = base + threadIdx.x; i < k_out; i += kThreads) dst[i] = -1;
}

}  // namespace

cudaError_t LaunchCompactSlots(const int32_t* in, int32_t* out, int64_t rows, int64_t k_in,
                               int64_t k_out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  CompactSlotsKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      in, out, static_cast<int>(k_in), static_cast<int>(k_out));
  return cudaGetLastError();
}

}  // namespace jax_dsa
