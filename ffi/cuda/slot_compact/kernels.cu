// Slot lists made valid-first (launch.h): one CTA a row. Stable compaction: CUB's block scan over
// tiles of 2048 slots (8 consecutive slots a thread, so that a thread's order is the list's
// order). Row sort: CUB's block radix sort of the row's slots as keys (invalid slots as the
// largest key), K up to kMaxSortSlots.
#include "cuda/slot_compact/launch.h"

#include <cub/block/block_radix_sort.cuh>
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

// Keys: the row for a valid slot, 2^bits - 1 (above every row) for an invalid one; only the low
// `bits` bits are sorted.
template <int THREADS, int ITEMS>
__global__ void __launch_bounds__(THREADS) SortSlotsKernel(const int32_t* __restrict__ in,
                                                           int32_t* __restrict__ out, int k_in,
                                                           int k_out, int bits) {
  using Sort = cub::BlockRadixSort<uint32_t, THREADS, ITEMS>;
  __shared__ typename Sort::TempStorage temp;
  const uint32_t invalid = (bits >= 32 ? 0u : (1u << bits)) - 1u;
  const int32_t* src = in + int64_t(blockIdx.x) * k_in;
  int32_t* dst = out + int64_t(blockIdx.x) * k_out;
  uint32_t key[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {  // striped loads (coalesced); the sort takes any arrangement
    const int i = j * THREADS + threadIdx.x;
    const int32_t v = i < k_in ? __ldg(src + i) : -1;
    key[j] = v >= 0 ? uint32_t(v) : invalid;
  }
  Sort(temp).SortBlockedToStriped(key, 0, bits);
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = j * THREADS + threadIdx.x;
    if (i < k_out) dst[i] = key[j] == invalid ? -1 : int32_t(key[j]);
  }
  for (int i = THREADS * ITEMS + threadIdx.x; i < k_out; i += THREADS) dst[i] = -1;
}

}  // namespace

cudaError_t LaunchCompactSlots(const int32_t* in, int32_t* out, int64_t rows, int64_t k_in,
                               int64_t k_out, int key_bits, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(rows);
  const int ki = static_cast<int>(k_in), ko = static_cast<int>(k_out);
  if (key_bits > 0 && k_in <= kMaxSortSlots) {
    if (k_in <= 2048) SortSlotsKernel<256, 8><<<grid, 256, 0, stream>>>(in, out, ki, ko, key_bits);
    else if (k_in <= 4096) SortSlotsKernel<256, 16><<<grid, 256, 0, stream>>>(in, out, ki, ko, key_bits);
    else SortSlotsKernel<512, 16><<<grid, 512, 0, stream>>>(in, out, ki, ko, key_bits);
  } else {
    CompactSlotsKernel<<<grid, kThreads, 0, stream>>>(in, out, ki, ko);
  }
  return cudaGetLastError();
}

}  // namespace jax_dsa
