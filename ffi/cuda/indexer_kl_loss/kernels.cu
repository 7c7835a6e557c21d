// The indexer KL loss kernels for SM90 and their launch code (contract and math: launch.h; the
// XLA FFI handlers: handler.cc). Plain CUDA C++. Kernel A: bf16 mma.sync.m16n8k16 with fp32
// accumulators, ldmatrix from XOR-swizzled shared memory (conflict-free), cp.async gathers of the
// slots' rows, thread-block clusters with distributed shared memory for the per-head softmax
// statistics of a row split over several CTAs. Kernel B: wgmma (sm90_wgmma.h).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/block/block_radix_sort.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/common/relu.h"
#include "cuda/common/sm90_wgmma.h"
#include "cuda/indexer_kl_loss/launch.h"

namespace cg = cooperative_groups;

namespace jax_dsa {
namespace indexer_kl {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// ---------------------------------------------------------------------------------------------
// PTX helpers

using sm90::CpAsync16;
using sm90::CpAsync16Zfill;
using sm90::CpAsyncCommit;
using sm90::SmemU32;

template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Adds x * scale, rounded to the nearest integer, to a 64-bit two's-complement fixed-point sum:
// integer addition is associative, so the sum is the same whatever order the adds land in.
// Returns whether x is finite (a NaN or inf cannot be held: the caller flags its row).
__device__ __forceinline__ bool RedAddFixed(unsigned long long* p, float x, float scale) {
  const bool finite = isfinite(x);
  const unsigned long long v =
      finite ? static_cast<unsigned long long>(__float2ll_rn(x * scale)) : 0ull;
  asm volatile("red.global.add.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
  return finite;
}

__device__ __forceinline__ void RedAddV4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}

// d[0 .. bytes) += s[0 .. bytes) in fp32 by the bulk-copy engine (asynchronous; bulk group).
__device__ __forceinline__ void BulkReduceAddF32(float* d, uint32_t s, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(d),
               "r"(s), "r"(bytes)
               : "memory");
}
// d[0 .. bytes) += s[0 .. bytes) as 64-bit integers (two's complement: signed sums wrap alike).
__device__ __forceinline__ void BulkReduceAddU64(unsigned long long* d, uint32_t s, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;\n" ::"l"(d),
               "r"(s), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk operations have read their shared-memory sources.
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void ClusterSync() {
  ClusterArrive();
  ClusterWait();
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---------------------------------------------------------------------------------------------
// Kernel A: target mass and index score.
//
// CTA tile: 64 head rows (the A operand: q of one 64-head group, or iq zero-padded to 64) x 256
// slots (B: the gathered rows), reduced over the width in chunks of 32 (one pipeline stage,
// 64-byte rows, 16-byte pieces XOR-swizzled by (row >> 1) & 3). Warp w owns slots 32w..32w+31 and
// all 64 rows: 4 m16 tiles x 4 n8 tiles, 64 fp32 accumulators per thread.

constexpr int kTileRows = 64;
constexpr int kChunk = 32;
constexpr int kStages = 4;
constexpr int kRowBytes = kChunk * 2;
constexpr int kStageABytes = kTileRows * kRowBytes;
constexpr int kStageBBytes = kSlotsPerCta * kRowBytes;
constexpr int kStageBytes = kStageABytes + kStageBBytes;

struct FwdSmem {
  alignas(128) unsigned char stage[kStages][kStageBytes];
  int rows[kSlotsPerCta];  // global key row of each slot, -1 off the support
  float red[kWarps][kTileRows];
  float cta_max[kTileRows];  // read by the cluster's other CTAs
  float cta_sum[kTileRows];  // read by the cluster's other CTAs
  float head_max[kTileRows];
  float coef[kTileRows];
  float w[kTileRows];
  float lse2[kTileRows];  // V4 mode: the group's given denominators in base 2 (+inf past H)
};

__device__ __forceinline__ uint32_t Swz64(int r, int c) {  // byte offset of piece c of row r
  return uint32_t(r * kRowBytes + ((c ^ ((r >> 1) & 3)) << 4));
}

__device__ __forceinline__ void FwdLoadChunk(FwdSmem& sm, int stage, const bf16* a,
                                             int64_t a_stride, int a_rows, const bf16* b,
                                             int64_t b_stride, int chunk, int tid) {
  const uint32_t sa = SmemU32(sm.stage[stage]);
  const uint32_t sb = sa + kStageABytes;
  {  // A: 64 rows x 4 pieces, one per thread; rows past a_rows are zero
    const int r = tid >> 2, c = tid & 3;
    const bool ok = r < a_rows;
    const bf16* src = a + (ok ? int64_t(r) * a_stride : 0) + chunk * kChunk + c * 8;
    CpAsync16Zfill(sa + Swz64(r, c), src, ok);
  }
#pragma unroll
  for (int i = 0; i < (kSlotsPerCta * 4) / kThreads; ++i) {  // B: 256 rows x 4 pieces
    const int p = tid + i * kThreads;
    const int r = p >> 2, c = p & 3;
    const int row = sm.rows[r];
    // Off-support slots are not loaded: their columns are masked with a select, and a column of
    // the product depends on its own B row only.
    if (row >= 0) CpAsync16(sb + Swz64(r, c), b + int64_t(row) * b_stride + chunk * kChunk + c * 8);
  }
}

__device__ __forceinline__ void FwdComputeChunk(float (&acc)[4][4][4], uint32_t sa, uint32_t sb,
                                                int warp, int lane) {
  const int mi = lane >> 3, l8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks) {
    uint32_t af[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      const int r = mt * 16 + (mi & 1) * 8 + l8;
      Ldsm4(af[mt], sa + Swz64(r, ks * 2 + (mi >> 1)));
    }
    uint32_t bfr[4][2];
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int r = warp * 32 + np * 16 + (mi >> 1) * 8 + l8;
      uint32_t x[4];
      Ldsm4(x, sb + Swz64(r, ks * 2 + (mi & 1)));
      bfr[2 * np][0] = x[0];
      bfr[2 * np][1] = x[1];
      bfr[2 * np + 1][0] = x[2];
      bfr[2 * np + 1][1] = x[3];
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) Mma(acc[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
  }
}

// acc = A (a_rows valid rows of stride a_stride, zero-padded to 64) . B[rows]^T over n_chunks * 32
// columns. Leaves every stage free (all copies landed, all warps done).
__device__ __forceinline__ void FwdGemm(FwdSmem& sm, float (&acc)[4][4][4], const bf16* a, int64_t a_stride,
                        int a_rows, const bf16* b, int64_t b_stride, int n_chunks, int tid) {
  const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_chunks) FwdLoadChunk(sm, s, a, a_stride, a_rows, b, b_stride, s, tid);
    CpAsyncCommit();
  }
  for (int c = 0; c < n_chunks; ++c) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // chunk c landed for every thread; chunk c - 1's stage is free
    const int nc = c + kStages - 1;
    if (nc < n_chunks) FwdLoadChunk(sm, nc % kStages, a, a_stride, a_rows, b, b_stride, nc, tid);
    CpAsyncCommit();
    const uint32_t sa = SmemU32(sm.stage[c % kStages]);
    FwdComputeChunk(acc, sa, sa + kStageABytes, warp, lane);
  }
  CpAsyncWait<0>();
  __syncthreads();
}

// kGivenLse: DeepSeek V4 mode (launch.h): the denominators come from a.lse, no cluster (the
// `cluster` CTAs of a row run independently) and the result is the log of the group's mass.
template <bool kGivenLse>
__global__ void __launch_bounds__(kThreads, 2) KlFwdKernel(const FwdArgs a, int cluster) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  FwdSmem& sm = *reinterpret_cast<FwdSmem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int64_t t = blockIdx.x / cluster;
  const int c = int(blockIdx.x % cluster);
  const int hg = blockIdx.y;
  const int64_t k = a.k, col0 = int64_t(c) * kSlotsPerCta;

  // The support of this CTA's slots.
  int my_row = -1;
  {
    const int64_t b = t / a.s_q;
    const int qp = a.q_pos[t];
    const int64_t col = col0 + tid;
    if (col < k) {
      const int i = a.idx[t * k + col];
      if (i >= 0 && i < a.s_kv) {
        const int64_t r = b * a.s_kv + i;
        if (a.kv_pos[r] <= qp && (a.q_seg == nullptr || a.kv_seg[r] == a.q_seg[t])) my_row = int(r);
      }
    }
    sm.rows[tid] = my_row;
    if (tid < kTileRows) sm.w[tid] = tid < a.h_i ? a.w[t * a.h_i + tid] : 0.f;
    if constexpr (kGivenLse) {
      if (a.lse != nullptr && tid >= kTileRows && tid < 2 * kTileRows) {
        const int64_t hh = int64_t(hg) * kTileRows + (tid - kTileRows);
        sm.lse2[tid - kTileRows] =
            hh < a.h ? a.lse[t * a.h + hh] * 1.4426950408889634f : INFINITY;  // padded: exp -> 0
      }
    }
  }
  const bool any = __syncthreads_or(my_row >= 0);  // also publishes rows and w

  float acc[4][4][4];
  bool vc[4][2];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) vc[nt][e] = sm.rows[warp * 32 + nt * 8 + 2 * q4 + e] >= 0;

  // Index score (head group 0 only): sum_hi w * relu(iq . ik).
#ifdef JAX_DSA_KL_ABLATE_SCORE  // timing ablation only: results wrong
  if (hg == 0) {
    if (any && a.k < 0)
#else
  if (hg == 0) {
    if (any)
#endif
      FwdGemm(sm, acc, a.iq + t * a.h_i * kIndexHeadDim, kIndexHeadDim, int(a.h_i), a.ik,
              kIndexHeadDim, kIndexHeadDim / kChunk, tid);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float s = 0.f;
        if (any) {
#pragma unroll
          for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
              s += sm.w[mt * 16 + g + 8 * half] * Relu(acc[mt][nt][half * 2 + e]);
        }
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        s += __shfl_xor_sync(0xffffffffu, s, 8);
        s += __shfl_xor_sync(0xffffffffu, s, 16);
        const int j = warp * 32 + nt * 8 + 2 * q4 + e;
        if (g == 0 && col0 + j < k) a.score[t * k + col0 + j] = vc[nt][e] ? s : -INFINITY;
      }
  }

  if (a.mass == nullptr) return;  // score-only launch (the target comes from elsewhere)

  // Main logits of this head group, in base 2.
  const int64_t h_left = a.h - int64_t(hg) * kTileRows;
  const int h_rows = h_left < kTileRows ? int(h_left) : kTileRows;
  if (any)
    FwdGemm(sm, acc, a.q + (t * a.h + int64_t(hg) * kTileRows) * a.d, a.d, h_rows, a.kv, a.d,
            int(a.d / kChunk), tid);
  const float scale = a.sm_scale * 1.4426950408889634f;

  if constexpr (kGivenLse) {
    // Per slot (a column: its 64 heads sit in this thread's 8 values and 8 lanes g), the log of
    // sum_h exp2(scale * logit - lse2[h]) with the column's max subtracted: exact whatever the
    // mass. No cross-CTA statistics: the denominators are given.
    float* out = a.mass + (int64_t(hg) * a.t + t) * k;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = any && vc[nt][e];
        float m = -INFINITY;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float v = ok ? acc[mt][nt][half * 2 + e] * scale - sm.lse2[mt * 16 + g + 8 * half]
                               : -INFINITY;
            acc[mt][nt][half * 2 + e] = v;
            m = fmaxf(m, v);
          }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        const bool finite = m > -INFINITY && m < INFINITY;
        const float mm = finite ? m : 0.f;
        float sum = 0.f;
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
          for (int half = 0; half < 2; ++half) sum += Exp2(acc[mt][nt][half * 2 + e] - mm);
        sum += __shfl_xor_sync(0xffffffffu, sum, 4);
        sum += __shfl_xor_sync(0xffffffffu, sum, 8);
        sum += __shfl_xor_sync(0xffffffffu, sum, 16);
        const int j = warp * 32 + nt * 8 + 2 * q4 + e;
        if (g == 0 && col0 + j < k)
          out[col0 + j] = !ok ? -INFINITY : (finite ? (m + log2f(sum)) * 0.6931471805599453f : m);
      }
    return;
  } else {
  cg::cluster_group cl = cg::this_cluster();

  // Per-head max over the row's support (this CTA, then the cluster).
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float v = (any && vc[nt][e]) ? acc[mt][nt][half * 2 + e] * scale : -INFINITY;
          acc[mt][nt][half * 2 + e] = v;
          m = fmaxf(m, v);
        }
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if (q4 == 0) sm.red[warp][mt * 16 + g + 8 * half] = m;
    }
  __syncthreads();
  if (tid < kTileRows) {
    float m = sm.red[0][tid];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, sm.red[w][tid]);
    sm.cta_max[tid] = m;
  }
  ClusterSync();  // every CTA of the cluster has published cta_max (and is running)
  if (tid < kTileRows) {
    float m = -INFINITY;
    for (int r = 0; r < cluster; ++r) m = fmaxf(m, *cl.map_shared_rank(&sm.cta_max[tid], r));
    sm.head_max[tid] = m == -INFINITY ? 0.f : m;  // a row without support: all exponentials 0
  }
  __syncthreads();

  // Exponentials (kept in place of the logits) and their per-head sums.
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float mx = sm.head_max[mt * 16 + g + 8 * half];
      float s = 0.f;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = Exp2(acc[mt][nt][half * 2 + e] - mx);
          acc[mt][nt][half * 2 + e] = x;
          s += x;
        }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (q4 == 0) sm.red[warp][mt * 16 + g + 8 * half] = s;
    }
  __syncthreads();
  if (tid < kTileRows) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sm.red[w][tid];
    sm.cta_sum[tid] = s;
  }
  ClusterSync();
  if (tid < kTileRows) {
    float z = 0.f;
    for (int r = 0; r < cluster; ++r) z += *cl.map_shared_rank(&sm.cta_sum[tid], r);
    sm.coef[tid] = (tid < h_rows && z > 0.f) ? 1.f / z : 0.f;  // padded heads excluded
  }
  ClusterArrive();  // this CTA's reads of the others' shared memory are done
  __syncthreads();

  // mass[j] = sum over this group's heads of exp / Z_h.
  float* mass = a.mass + (int64_t(hg) * a.t + t) * k;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float s = 0.f;
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          s += acc[mt][nt][half * 2 + e] * sm.coef[mt * 16 + g + 8 * half];
      s += __shfl_xor_sync(0xffffffffu, s, 4);
      s += __shfl_xor_sync(0xffffffffu, s, 8);
      s += __shfl_xor_sync(0xffffffffu, s, 16);
      const int j = warp * 32 + nt * 8 + 2 * q4 + e;
      if (g == 0 && col0 + j < k) mass[col0 + j] = vc[nt][e] ? s : 0.f;
    }
  ClusterWait();  // no CTA leaves while another may still read its shared memory
  }
}

// ---------------------------------------------------------------------------------------------
// Kernel B: the indexer's gradients, slot tiles of 64.

constexpr int kBTile = 64;
constexpr int kBRowBytes = kIndexHeadDim * 2;
constexpr int kMaxTiles = kMaxTopk / kBTile;

// Slot j of row t (batch element b): its key row, or -1 when it adds nothing (j past K, an index
// outside [0, s_kv), dscore 0); d its dscore (0 for -1).
__device__ __forceinline__ int BwdSlot(const BwdArgs& a, int64_t t, int64_t b, int j, float& d) {
  d = 0.f;
  if (j >= a.k) return -1;
  const int i = a.idx[t * a.k + j];
  const float x = a.dscore[t * a.k + j];
  if (i < 0 || i >= a.s_kv || x == 0.f) return -1;
  d = x;
  return int(b * a.s_kv + i);
}

// The dense form's slot (BwdArgs::index_lse given): d = the target p[t, j]; every slot with an
// index in [0, s_kv) contributes (its dscore exp(I - lse) - p is formed from the recomputed I).
__device__ __forceinline__ int BwdSlotDense(const BwdArgs& a, int64_t t, int64_t b, int j, float& d) {
  d = 0.f;
  if (j >= a.k) return -1;
  const int i = a.idx[t * a.k + j];
  if (i < 0 || i >= a.s_kv) return -1;
  d = a.target[t * a.k + j];
  return int(b * a.s_kv + i);
}

// One warpgroup per query row, slot tiles of 64 in a 2- to 4-stage cp.async ring; the row's index query iq [HI, 128] stays resident. Operands in the
// 128-byte swizzle (sm90_wgmma.h), each tile's key rows ik [64, 128] read both K-major and M-major:
//   (1) S^T = ik . iq^T        m64 nHI k16 x 8, both operands from shared memory
//       G^T = dscore * w * (S > 0), rounded to bf16 in registers and stored [hi][slot]
//   (3) U = G^T . iq           m64 n128 k16 x HI/16, A from registers (the layout of (1)'s
//                              accumulator), B = iq read N-major
//   (2) dQ^T += ik^T . G^T     2 x m64 nHI k16 x 4, A = ik read M-major
// U is added to the slots' d_ik rows, by red.v4 atomics or (BULK) staged in shared memory and sent
// as one 512-byte bulk reduction a row (the same bytes in a quarter of the L2 requests). S of tile
// it + 1 is issued before tile it's additions, so that they overlap. dQ^T and d_w stay in
// registers until the row ends; no ldmatrix traffic.
constexpr int kWgThreads = 128;
constexpr int kWgTileBytes = kBTile * kBRowBytes;  // 16 KiB

constexpr int kUbStride = 132;  // floats a staged U row: 512 bytes + 16 (conflict-free stores)
// FIXED with BULK: U as int64, half a tile (32 rows) at a time in the same room.
constexpr int kUb64Stride = 130;  // int64 a staged row: 1024 bytes + 16
static_assert(32 * kUb64Stride * 8 <= kBTile * kUbStride * 4, "the int64 half tile fits the staging");

template <int HI, int STAGES, bool BULK>
struct BwdWgSmem {
  unsigned char ik[STAGES][kWgTileBytes];
  unsigned char iq[HI * kBRowBytes];
  unsigned char gs[HI * 128];  // G bf16: [hi][slot] (HI 32) or [slot][hi] (HI 64), 128-byte rows
  float ub[BULK ? kBTile * kUbStride : 4];  // BULK: U staged for the bulk reductions
  float w[HI];
  float dw_red[4][HI];
  int n_tiles;
  int tiles[kMaxTiles];      // the tiles with at least one contributing slot
  int flags[2 * kMaxTiles];  // whether each run of 32 slots has one
  // then rows [k_pad] int32 and dscore [k_pad] float32 (dynamic)
};

// The ring's depth: BULK's staging of U takes a stage's room (PAIR's two, at HI 64), so that two
// CTAs fit an SM.
constexpr int WgStages(bool bulk, bool pair) { return bulk ? (pair ? 2 : 3) : 4; }

// DENSE: dscore is formed in the kernel from the recomputed score (BwdArgs::index_lse, ::target,
// ::score): dscore[t, j] = exp(I[t, j] - index_lse[t]) - target[t, j] on the valid slots, and I is
// written out. The head sum of I is each thread's heads in order, then the quad (xor 1, 2).
// PAIR (DENSE, HI 64, H_I <= 32): rows 2c and 2c + 1 in one CTA, their index heads stacked as 64
// "heads" (row r's head h at 32 r + h). Where the two rows' slot lists agree (each slot one key or
// invalid in one of them: neighbouring rows of a dense chunk), S, G and dQ are the 64-head
// products of one tile and U = sum over both rows, so that each key row gets one reduction for
// both. Where they disagree (a document or batch boundary), the CTA runs twice, one row masked.
// FIXED (BwdArgs::d_ik_fixed, the deterministic mode): U is added to d_ik_fixed as 64-bit
// fixed point instead of to d_ik (RedAddFixed; with BULK, staged as int64 half a tile at a time
// and sent as one 1024-byte bulk u64 reduction a row); LaunchBwd converts the sums to d_ik
// afterwards.
// SORT (the sparse form; experiment, see LaunchBwd): each row's (key row, dscore) pairs are sorted
// by key row before the tiles are formed, so that the CTAs of a wave launch sweep d_ik's rows
// together. Rows t0 + blockIdx.x (PAIR: t0 + 2 blockIdx.x and the next).
template <int HI, bool BULK, bool DENSE = false, bool PAIR = false, bool FIXED = false, bool SORT = false>
__global__ void __launch_bounds__(kWgThreads, 2) KlBwdKernelWg(const BwdArgs a, const int64_t t0) {
  using namespace sm90;
  static_assert(!PAIR || (DENSE && HI == 64), "PAIR: the dense form at 64 stacked heads");
  static_assert(!(FIXED && BULK) || (HI == 32 && !PAIR), "FIXED's bulk staging: one row of 32 heads");
  static_assert(!SORT || (HI == 32 && !DENSE && !PAIR), "SORT: the sparse form at 32 heads");
  constexpr int kWgStages = WgStages(BULK, PAIR);
  constexpr int NA = HI / 2;   // accumulator floats of an m64 nHI tile
  constexpr int KK = HI / 16;  // k16 steps of (3)
  constexpr int HR = PAIR ? 32 : HI;  // index heads a row
  extern __shared__ unsigned char smem_raw[];
  // The swizzle atoms (8 rows x 128 B) must start on 1024-byte boundaries.
  unsigned char* base = smem_raw + ((1024 - (SmemU32(smem_raw) & 1023)) & 1023);
  BwdWgSmem<HI, kWgStages, BULK>& sm = *reinterpret_cast<BwdWgSmem<HI, kWgStages, BULK>*>(base);
  const int64_t k = a.k;
  const int n_all = int((k + kBTile - 1) / kBTile);
  const int k_pad = n_all * kBTile;
  int* rows = reinterpret_cast<int*>(base + sizeof(BwdWgSmem<HI, kWgStages, BULK>));
  float* ds = reinterpret_cast<float*>(rows + k_pad);  // !PAIR: dscore, or the dense target
  uint8_t* vf = reinterpret_cast<uint8_t*>(rows + k_pad);  // PAIR: bit r, valid for row r

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int r0 = 16 * warp + g;  // this thread's accumulator rows: r0, r0 + 8
  // (the first) query row; t0 only with SORT (the other launches are one wave: t0 = 0)
  const int64_t t = (SORT ? t0 : 0) + (PAIR ? 2 * int64_t(blockIdx.x) : blockIdx.x);
  const bool has1 = PAIR && t + 1 < a.t;                            // PAIR: row t + 1 exists
  const int64_t b = t / a.s_q;
  const uint32_t s_iq = SmemU32(sm.iq), s_g = SmemU32(sm.gs), s_ik = SmemU32(sm.ik[0]);

  // Head c of the stacking: (row t + c / HR, head c % HR), absent past H_I or past T.
  auto head_ok = [&](int c) { return c % HR < a.h_i && (c < HR || has1); };
  auto head_at = [&](int c) { return (t + c / HR) * a.h_i + c % HR; };
  auto load_iq = [&]() {  // iq[t] (and iq[t + 1]), zero rows past H_I
    for (int p = tid; p < HI * 16; p += kWgThreads) {
      const int r = p >> 4, c = p & 15;
      const bool ok = head_ok(r);
      CpAsync16Zfill(s_iq + WgChunk(r, c, HI),
                     a.iq + (ok ? head_at(r) : t * a.h_i) * kIndexHeadDim + c * 8, ok);
    }
    CpAsyncCommit();
  };
  if constexpr (!PAIR) load_iq();
  if (tid < HI) sm.w[tid] = head_ok(tid) ? a.w[head_at(tid)] : 0.f;
  // PAIR: whether the rows' slot lists disagree somewhere (then one pass a row), and whether
  // either row has a slot (the dense chunks' rows before a chunk have none: no copies then).
  bool split = false, live = true;
  if constexpr (PAIR) {
    const int64_t b1 = (t + 1) / a.s_q;
    bool bad = false, some = false;
    for (int j = tid; j < k_pad; j += kWgThreads) {
      float d;
      const int x = BwdSlotDense(a, t, b, j, d);
      const int y = has1 ? BwdSlotDense(a, t + 1, b1, j, d) : -1;
      bad |= x >= 0 && y >= 0 && x != y;
      some |= x >= 0 || y >= 0;
      if (x < 0 && j < k) a.score[t * k + j] = -INFINITY;  // valid slots: in make_g
      if (has1 && y < 0 && j < k) a.score[(t + 1) * k + j] = -INFINITY;
    }
    split = __syncthreads_or(bad);
    live = __syncthreads_or(some);
    if (live) load_iq();
  }
  __syncthreads();  // w published
  const float lse0 = DENSE ? a.index_lse[t] : 0.f;
  const float lse1 = has1 ? a.index_lse[t + 1] : 0.f;
  // w of heads 8 j + 2 q4 + e (index 2 j + e): in registers, or (PAIR, short of them) from
  // shared memory at each use.
  float wv[PAIR ? 1 : NA / 2];
  if constexpr (!PAIR) {
#pragma unroll
    for (int j = 0; j < HI / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) wv[2 * j + e] = sm.w[8 * j + 2 * q4 + e];
  }
  auto w_of = [&](int i) {
    if constexpr (PAIR)
      return sm.w[8 * (i >> 1) + 2 * q4 + (i & 1)];
    else
      return wv[i];
  };

  auto load_tile = [&](int stage, int tile) {
    const uint32_t dst = s_ik + stage * kWgTileBytes;
#pragma unroll
    for (int i = 0; i < (kBTile * 16) / kWgThreads; ++i) {
      const int p = tid + i * kWgThreads;
      const int r = p >> 4, c = p & 15;
      const int row = rows[tile * kBTile + r];
      // Zero rows for the tile's other slots: G is 0 there, and 0 * (stale NaN) would not be.
      CpAsync16Zfill(dst + WgChunk(r, c, kBTile),
                     a.ik + int64_t(row < 0 ? 0 : row) * kIndexHeadDim + c * 8, row >= 0);
    }
  };
  int n_act = 0;  // this pass's active tiles

  float acc_q[2][NA];  // dQ^T: dims 64 mb + r0 (+8) x heads 8 j + 2 q4 + e
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int i = 0; i < NA; ++i) acc_q[mb][i] = 0.f;
  float dw[NA / 2];  // d_w partial sums of heads 8 j + 2 q4 + e, index 2 j + e
#pragma unroll
  for (int i = 0; i < NA / 2; ++i) dw[i] = 0.f;

  auto stage_of = [&](int it) { return s_ik + (it % kWgStages) * kWgTileBytes; };
  float acc_s[NA];  // (1): S^T [slot, hi]
  auto issue_s = [&](int it) {
    const uint32_t st = stage_of(it);
    WgFenceOperand(acc_s);
    WgFence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t off = (ks >> 2) * (kBTile * 128) + (ks & 3) * 32;
      const uint32_t off_q = (ks >> 2) * (HI * 128) + (ks & 3) * 32;
      WgMmaSS<0, 0>(acc_s, WgDesc(st + off), WgDesc(s_iq + off_q), ks > 0);
    }
    WgCommit();
    WgFenceOperand(acc_s);
  };
  // Tile it's copies landed (LAG younger groups may be pending) and are visible to the async
  // proxy of every thread.
  auto landed = [&]() {
    CpAsyncWait<kWgStages - 2>();
    FenceProxyAsync();
    __syncthreads();
  };
  uint32_t ga[KK][4];  // (3)'s A fragments: k16 step kk = heads 16 kk..
  // PAIR: the targets of slots r0, r0 + 8 of tile it, rows t, t + 1 (loaded a tile ahead).
  float pt[4];
  auto fetch_p = [&](int it) {
    if constexpr (PAIR) {
      if (it < n_act) {
        const int j = sm.tiles[it] * kBTile + r0;
        const uint8_t f_lo = vf[j], f_hi = vf[j + 8];
        pt[0] = f_lo & 1 ? a.target[t * k + j] : 0.f;
        pt[1] = f_hi & 1 ? a.target[t * k + j + 8] : 0.f;
        pt[2] = f_lo & 2 ? a.target[(t + 1) * k + j] : 0.f;
        pt[3] = f_hi & 2 ? a.target[(t + 1) * k + j + 8] : 0.f;
      }
    }
  };
  // G^T = dscore * w * (S > 0) from S(it), to registers and to shared memory; d_w += dscore *
  // relu(S). Ends with every thread's G stored.
  auto make_g = [&](int it) {
    const int j0 = sm.tiles[it] * kBTile;
    WgFenceOperand(acc_s);
    // dscore of slots r0 (dl) and r0 + 8 (dh) for row t (and, PAIR, t + 1: heads j >= 4).
    float dl[2], dh[2];
    if constexpr (!PAIR) {
      dl[0] = ds[j0 + r0];
      dh[0] = ds[j0 + r0 + 8];
    }
    if constexpr (DENSE) {
      // I of slots r0, r0 + 8 a row (this thread's heads, then the quad)
      float il[2] = {0.f, 0.f}, ih[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < HI / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = PAIR ? j / 4 : 0;
          il[r] = fmaf(Relu(acc_s[4 * j + e]), w_of(2 * j + e), il[r]);
          ih[r] = fmaf(Relu(acc_s[4 * j + 2 + e]), w_of(2 * j + e), ih[r]);
        }
#pragma unroll
      for (int r = 0; r < (PAIR ? 2 : 1); ++r) {
#pragma unroll
        for (int mask = 1; mask <= 2; mask <<= 1) {
          il[r] += __shfl_xor_sync(0xffffffffu, il[r], mask);
          ih[r] += __shfl_xor_sync(0xffffffffu, ih[r], mask);
        }
        bool v_lo, v_hi;
        float p_lo, p_hi;
        if constexpr (PAIR) {
          v_lo = (vf[j0 + r0] >> r) & 1;
          v_hi = (vf[j0 + r0 + 8] >> r) & 1;
          p_lo = pt[2 * r];
          p_hi = pt[2 * r + 1];
        } else {
          v_lo = rows[j0 + r0] >= 0;
          v_hi = rows[j0 + r0 + 8] >= 0;
          p_lo = dl[0];
          p_hi = dh[0];
        }
        const float lse = r ? lse1 : lse0;
        dl[r] = v_lo ? __expf(il[r] - lse) - p_lo : 0.f;
        dh[r] = v_hi ? __expf(ih[r] - lse) - p_hi : 0.f;
        if (q4 == 0) {
          if (v_lo) a.score[(t + r) * k + j0 + r0] = il[r];
          if (v_hi) a.score[(t + r) * k + j0 + r0 + 8] = ih[r];
        }
      }
      fetch_p(it + 1);
    }
#pragma unroll
    for (int j = 0; j < HI / 8; ++j) {
      uint32_t pk[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = PAIR ? j / 4 : 0;
        const float d = hr ? dh[r] : dl[r];
        const float x0 = acc_s[4 * j + 2 * hr], x1 = acc_s[4 * j + 2 * hr + 1];
        dw[2 * j] += d * Relu(x0);
        dw[2 * j + 1] += d * Relu(x1);
        pk[hr] = PackBf16(x0 > 0.f ? d * w_of(2 * j) : 0.f, x1 > 0.f ? d * w_of(2 * j + 1) : 0.f);
        // G: heads 8 j + 2 q4 (+1), slot r0 + 8 hr. At HI 64, [slot][hi] (the accumulator's
        // layout: one 4-byte store for both heads; (2) reads it N-major); at 32, [hi][slot]
        // (a 32-head row is too short for the 128-byte swizzle read N-major).
        const int sl = r0 + 8 * hr, hc = 8 * j + 2 * q4;
        if constexpr (HI == 64) {
          const uint32_t a = s_g + WgChunk(sl, j, kBTile) + 4 * q4;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(pk[hr]) : "memory");
        } else {
          const uint32_t a0 = s_g + WgChunk(hc, sl >> 3, HI) + (sl & 7) * 2;
          const uint32_t a1 = s_g + WgChunk(hc + 1, sl >> 3, HI) + (sl & 7) * 2;
          asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(a0), "h"(uint16_t(pk[hr] & 0xFFFF)) : "memory");
          asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(a1), "h"(uint16_t(pk[hr] >> 16)) : "memory");
        }
      }
      ga[j >> 1][(j & 1) * 2] = pk[0];
      ga[j >> 1][(j & 1) * 2 + 1] = pk[1];
    }
    FenceProxyAsync();
    __syncthreads();  // all of G stored before (2) reads it
  };
  float acc_u[64];  // (3): U [slot, d]
  auto issue_uq = [&](int it) {
    const uint32_t st = stage_of(it);
    WgFenceOperand(acc_u);
    WgFence();
#pragma unroll
    for (int kk = 0; kk < KK; ++kk)
      WgMmaRS<1>(acc_u, ga[kk], WgDescMN(s_iq + kk * 2048, HI * 128), kk > 0);
#pragma unroll
    for (int mb = 0; mb < 2; ++mb)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        if constexpr (HI == 64)
          WgMmaSS<1, 1>(acc_q[mb], WgDescMN(st + mb * (kBTile * 128) + ks * 2048, kBTile * 128),
                        WgDescMN(s_g + ks * 2048, kBTile * 128), 1);
        else
          WgMmaSS<1, 0>(acc_q[mb], WgDescMN(st + mb * (kBTile * 128) + ks * 2048, kBTile * 128),
                        WgDesc(s_g + ks * 32), 1);
    WgCommit();
    WgFenceOperand(acc_u);
  };
  // U rows into d_ik. Without BULK, lane pairs swap halves so that each adds 4 consecutive floats
  // of a row with red.v4; with it, U is staged in shared memory and each valid row goes to L2 as
  // one 512-byte bulk reduction (cp.reduce.async.bulk .add.f32).
  auto add_u = [&](int it) {
    WgFenceOperand(acc_u);
    WgFenceOperand(acc_q[0]);
    WgFenceOperand(acc_q[1]);
    const int j0 = sm.tiles[it] * kBTile;
    if constexpr (FIXED && BULK) {
      // Rows 32 h .. 32 h + 31 (warps 2 h, 2 h + 1) in round h: the int64 half tile fills the
      // float staging's room; as the f32 path, one bulk reduction a valid row.
      const float scale = *a.fixed_scale;
      unsigned long long* ub64 = reinterpret_cast<unsigned long long*>(sm.ub);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (tid < 32) BulkWaitRead();  // the previous round's reductions have read the staging
        __syncthreads();
        if ((warp >> 1) == h) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            bool finite = true;
            unsigned long long* dst = ub64 + (r0 + 8 * hr - 32 * h) * kUb64Stride + 2 * q4;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              const float x0 = acc_u[4 * j + 2 * hr], x1 = acc_u[4 * j + 2 * hr + 1];
              const bool f0 = isfinite(x0), f1 = isfinite(x1);
              finite &= f0 && f1;
              const unsigned long long v0 = f0 ? static_cast<unsigned long long>(__float2ll_rn(x0 * scale)) : 0ull;
              const unsigned long long v1 = f1 ? static_cast<unsigned long long>(__float2ll_rn(x1 * scale)) : 0ull;
              asm volatile("st.shared.v2.u64 [%0], {%1, %2};\n" ::"r"(SmemU32(dst + 8 * j)), "l"(v0), "l"(v1)
                           : "memory");
            }
            const int row = rows[j0 + r0 + 8 * hr];
            if (!finite && row >= 0) atomicOr(a.d_ik_nonfinite + row, 1u);
          }
        }
        FenceProxyAsync();
        __syncthreads();
        if (tid < 32) {
          const int row = rows[j0 + 32 * h + tid];
          if (row >= 0)
            BulkReduceAddU64(a.d_ik_fixed + int64_t(row) * kIndexHeadDim, SmemU32(ub64 + tid * kUb64Stride),
                             kIndexHeadDim * 8);
          BulkCommit();
        }
      }
    } else if constexpr (FIXED) {
      // acc_u[4 j + 2 hr + e] is U[slot r0 + 8 hr, column 8 j + 2 q4 + e].
      const float scale = *a.fixed_scale;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int row = rows[j0 + r0 + 8 * hr];
        if (row < 0) continue;
        unsigned long long* dst = a.d_ik_fixed + int64_t(row) * kIndexHeadDim + 2 * q4;
        bool finite = true;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          finite &= RedAddFixed(dst + 8 * j, acc_u[4 * j + 2 * hr], scale);
          finite &= RedAddFixed(dst + 8 * j + 1, acc_u[4 * j + 2 * hr + 1], scale);
        }
        if (!finite) atomicOr(a.d_ik_nonfinite + row, 1u);
      }
    } else if constexpr (BULK) {
      if (tid < kBTile) BulkWaitRead();  // the previous tile's reductions have read the staging
      __syncthreads();
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<float2*>(&sm.ub[(r0 + 8 * hr) * kUbStride + 8 * j + 2 * q4]) =
              make_float2(acc_u[4 * j + 2 * hr], acc_u[4 * j + 2 * hr + 1]);
      FenceProxyAsync();
      __syncthreads();
      if (tid < kBTile) {
        const int row = rows[j0 + tid];
        if (row >= 0)
          BulkReduceAddF32(a.d_ik + int64_t(row) * kIndexHeadDim, SmemU32(&sm.ub[tid * kUbStride]),
                           kIndexHeadDim * 4);
        BulkCommit();
      }
    } else {
      const bool even = (q4 & 1) == 0;
      const int row = rows[j0 + r0 + (even ? 0 : 8)];
      float* dst = a.d_ik + int64_t(row < 0 ? 0 : row) * kIndexHeadDim + 2 * (q4 & ~1);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float4 v = RowQuad(acc_u, j, even);
        if (row >= 0) RedAddV4(dst + 8 * j, v.x, v.y, v.z, v.w);
      }
    }
  };
  // The next copy: tile it + kWgStages - 1 into the stage that tile it - 1 used (free once every
  // thread passed the barrier after that tile's last wgmma wait).
  auto refill = [&](int it) {
    if (it + kWgStages - 1 < n_act)
      load_tile((it + kWgStages - 1) % kWgStages, sm.tiles[it + kWgStages - 1]);
    CpAsyncCommit();
  };

  const int n_pass = !live ? 0 : split ? 2 : 1;
  for (int pass = 0; pass < n_pass; ++pass) {
    // PAIR: the rows this pass serves (bit r: row t + r).
    const int serve = split ? 1 << pass : 3;
    __syncthreads();  // the last pass's reads of rows and tiles are done
    for (int j = tid; j < k_pad; j += kWgThreads) {  // whole warps: k_pad is a multiple of 64
      float d;
      int row;
      if constexpr (PAIR) {
        const int x = (serve & 1) ? BwdSlotDense(a, t, b, j, d) : -1;
        const int y = (serve & 2) && has1 ? BwdSlotDense(a, t + 1, (t + 1) / a.s_q, j, d) : -1;
        row = x >= 0 ? x : y;
        vf[j] = uint8_t((x >= 0) | ((y >= 0) << 1));
      } else {
        row = DENSE ? BwdSlotDense(a, t, b, j, d) : BwdSlot(a, t, b, j, d);
        ds[j] = d;
        if (DENSE && row < 0 && j < k) a.score[t * k + j] = -INFINITY;  // valid slots: in make_g
      }
      rows[j] = row;
      const unsigned m = __ballot_sync(0xffffffffu, row >= 0);
      if (lane == 0) sm.flags[j >> 5] = m != 0;
    }
    __syncthreads();
    if constexpr (SORT) {
      // By key row, -1 last (all ones in the sorted bits: above every row < NB * s_kv), in the
      // key-tile ring (no tile is loaded yet). Striped in and out (slot tid + 128 i: no bank
      // conflicts); the input order only orders equal rows, in a fixed way.
      static_assert(kMaxTopk % kWgThreads == 0, "whole items a thread");
      using Sort = cub::BlockRadixSort<uint32_t, kWgThreads, kMaxTopk / kWgThreads, float>;
      static_assert(sizeof(typename Sort::TempStorage) <= sizeof(sm.ik), "sort storage in the ring");
      constexpr int E = kMaxTopk / kWgThreads;
      const uint32_t n_rows = uint32_t((a.t / a.s_q) * a.s_kv);
      const int bits = 32 - __clz(n_rows);  // 2^bits - 1 >= n_rows > every row
      uint32_t keys[E];
      float vals[E];
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const int j = tid + kWgThreads * i;
        const int r = j < k_pad ? rows[j] : -1;
        keys[i] = r < 0 ? 0xffffffffu : uint32_t(r);
        vals[i] = r < 0 ? 0.f : ds[j];
      }
      __syncthreads();  // every read of rows and ds done
      Sort(*reinterpret_cast<typename Sort::TempStorage*>(&sm.ik[0][0])).SortBlockedToStriped(keys, vals, 0, bits);
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const int j = tid + kWgThreads * i;
        if (j < k_pad) {
          rows[j] = keys[i] == 0xffffffffu ? -1 : int(keys[i]);
          ds[j] = vals[i];
        }
      }
      __syncthreads();
      for (int j = tid; j < k_pad; j += kWgThreads) {  // whole warps: k_pad is a multiple of 64
        const unsigned m = __ballot_sync(0xffffffffu, rows[j] >= 0);
        if (lane == 0) sm.flags[j >> 5] = m != 0;
      }
      __syncthreads();
    }
    if (warp == 0) {  // compact the active tiles (at most 32: one a lane)
      const bool act = lane < n_all && (sm.flags[2 * lane] | sm.flags[2 * lane + 1]);
      const unsigned m = __ballot_sync(0xffffffffu, act);
      if (act) sm.tiles[__popc(m & ((1u << lane) - 1))] = lane;
      if (lane == 0) sm.n_tiles = __popc(m);
    }
    __syncthreads();
    n_act = sm.n_tiles;
#pragma unroll
    for (int s = 0; s < kWgStages - 1; ++s) {
      if (s < n_act) load_tile(s, sm.tiles[s]);
      CpAsyncCommit();
    }
    fetch_p(0);

    if (n_act > 0) {
      // S of tile it + 1 is issued before tile it's atomics, so that they overlap; no branch
      // between a wgmma's issue and its wait.
      landed();
      issue_s(0);
      int it = 0;
      for (; it + 1 < n_act; ++it) {
        WgWait<0>();     // S(it)
        __syncthreads();  // every thread's wgmmas of tile it - 1 are done: its stage and G are free
        refill(it);
        make_g(it);
        issue_uq(it);
        landed();        // tile it + 1 (the copy group of tile it + 1 is the third youngest)
        issue_s(it + 1);
        WgWait<1>();     // U(it) and dQ(it)
        add_u(it);
      }
      WgWait<0>();
      __syncthreads();
      refill(it);
      make_g(it);
      issue_uq(it);
      WgWait<0>();
      add_u(it);
    }
    CpAsyncWait<0>();
  }  // passes
  if constexpr (BULK) {
    if (tid < kBTile) BulkWaitRead();  // the staging is read before the CTA's shared memory goes
  }

  // d_iq[t, hi, d] from dQ^T.
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int j = 0; j < HI / 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int hi = 8 * j + 2 * q4 + e, d = 64 * mb + r0 + 8 * hr;
          if (head_ok(hi)) a.d_iq[head_at(hi) * kIndexHeadDim + d] = acc_q[mb][4 * j + 2 * hr + e];
        }
  // d_w: sum over the 8 row groups of a warp, then over the 4 warps.
#pragma unroll
  for (int i = 0; i < NA / 2; ++i) {
    float v = dw[i];
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    if (g == 0) sm.dw_red[warp][8 * (i >> 1) + 2 * q4 + (i & 1)] = v;
  }
  __syncthreads();
  if (tid < HI && head_ok(tid))
    a.d_w[head_at(tid)] = sm.dw_red[0][tid] + sm.dw_red[1][tid] + sm.dw_red[2][tid] + sm.dw_red[3][tid];
}

int FwdClusters(int64_t k) { return int((k + kSlotsPerCta - 1) / kSlotsPerCta); }

template <int HI, bool BULK, bool DENSE = false, bool PAIR = false, bool FIXED = false, bool SORT = false>
cudaError_t LaunchBwdWgHi(const BwdArgs& a, cudaStream_t stream) {
  const int64_t k_pad = (a.k + kBTile - 1) / kBTile * kBTile;
  constexpr int kStages = WgStages(BULK, PAIR);
  // rows (int32) and dscore (float32) or PAIR's validity bits (uint8) a slot; + alignment
  const size_t smem = sizeof(BwdWgSmem<HI, kStages, BULK>) + size_t(k_pad) * (PAIR ? 5 : 8) + 1024;
  auto kernel = KlBwdKernelWg<HI, BULK, DENSE, PAIR, FIXED, SORT>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  // SORT: one wave of resident CTAs a launch (the rows of concurrent CTAs then sweep d_ik together).
  int64_t wave = INT64_MAX;
  if constexpr (SORT) {
    int dev = 0, sms = 0, per_sm = 0;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
    if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
    if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWgThreads, smem)) != cudaSuccess)
      return e;
    if (sms > 0 && per_sm > 0) wave = int64_t(sms) * per_sm;
  }
  const int64_t ctas = PAIR ? (a.t + 1) / 2 : a.t;
  for (int64_t c0 = 0; c0 < ctas; c0 += wave) {  // (one launch unless SORT)
    const int64_t grid = ctas - c0 < wave ? ctas - c0 : wave;
    kernel<<<dim3(unsigned(grid)), kWgThreads, smem, stream>>>(a, PAIR ? 2 * c0 : c0);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// The experiments read at launch (benchmarks/notes/indexer_kl_loss.md, session 40): whether the
// variable `name` is `value`.
bool EnvIs(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}
// JAX_DSA_KL_SORT_WAVES: "1" sorts and launches waves once d_ik's accumulator (bytes_per_row a
// key row) outgrows the device's L2 cache, "force" at any size (for tests on small shapes).
bool SortWaves(int64_t key_rows, int bytes_per_row) {
  if (EnvIs("JAX_DSA_KL_SORT_WAVES", "force")) return true;
  if (!EnvIs("JAX_DSA_KL_SORT_WAVES", "1")) return false;
  int dev = 0, l2 = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev) != cudaSuccess)
    return false;
  return key_rows * bytes_per_row > int64_t(l2);
}

}  // namespace

const char* FwdUnsupported(const FwdArgs& a) {
  if (a.d < kChunk || a.d % kChunk != 0) return "D_qk must be a positive multiple of 32";
  if (a.h < 1 || a.h > kMaxHeads) return "H must be in [1, 128]";
  if (a.h_i < 1 || a.h_i > kMaxIndexHeads) return "index_n_heads must be in [1, 64]";
  if (a.k < 1 || a.k > kMaxTopk) return "K must be in [1, 2048]";
  if (a.s_q < 1 || a.s_kv < 1 || a.t % a.s_q != 0) return "S_q and S_kv must be >= 1, T a multiple of S_q";
  if ((a.t / a.s_q) * a.s_kv > INT32_MAX) return "NB * S_kv must be < 2^31";
  if (a.t * FwdClusters(a.k) > INT32_MAX) return "T * ceil(K / 256) must be < 2^31";
  if ((a.q_seg == nullptr) != (a.kv_seg == nullptr)) return "give both segment ids or neither";
  return nullptr;
}

const char* BwdUnsupported(const BwdArgs& a) {
  if (a.h_i < 1 || a.h_i > kMaxIndexHeads) return "index_n_heads must be in [1, 64]";
  if (a.k < 1 || a.k > kMaxTopk) return "K must be in [1, 2048]";
  if (a.s_q < 1 || a.s_kv < 1 || a.t % a.s_q != 0) return "S_q and S_kv must be >= 1, T a multiple of S_q";
  if ((a.t / a.s_q) * a.s_kv > INT32_MAX) return "NB * S_kv must be < 2^31";
  if (a.t > INT32_MAX) return "T must be < 2^31";
  if ((a.index_lse == nullptr) != (a.target == nullptr) || (a.index_lse == nullptr) != (a.score == nullptr))
    return "the dense form takes index_lse, target and score together";
  if ((a.index_lse == nullptr) == (a.dscore == nullptr)) return "give dscore or the dense form's inputs";
  return nullptr;
}

cudaError_t LaunchFwd(const FwdArgs& a, cudaStream_t stream) {
  if (a.t == 0) return cudaSuccess;
  const int cluster = FwdClusters(a.k);
  const size_t smem = sizeof(FwdSmem);
  if (a.mass == nullptr || a.lse != nullptr) {
    // V4 (the denominators are given) and score-only launches: the CTAs of a row are
    // independent, no cluster; score-only runs head group 0 alone.
    cudaError_t e = cudaFuncSetAttribute(KlFwdKernel<true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
    const unsigned groups = a.mass == nullptr ? 1u : unsigned((a.h + kTileRows - 1) / kTileRows);
    const dim3 grid(unsigned(a.t * cluster), groups, 1);
    KlFwdKernel<true><<<grid, kThreads, smem, stream>>>(a, cluster);
    return cudaGetLastError();
  }
  cudaError_t e = cudaFuncSetAttribute(KlFwdKernel<false>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(a.t * cluster), unsigned((a.h + kTileRows - 1) / kTileRows), 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, KlFwdKernel<false>, a, cluster);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

// d_ik = d_ik_fixed / scale (exact power of two), element by element; NaN in the rows that were
// given a non-finite term.
__global__ void FixedToFloatKernel(const unsigned long long* fixed, const unsigned* nonfinite,
                                   const float* scale, float* out, int64_t n) {
  const double inv = 1.0 / double(*scale);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = nonfinite[i / kIndexHeadDim] ? NAN
                                          : float(double(static_cast<long long>(fixed[i])) * inv);
}

cudaError_t LaunchBwd(const BwdArgs& a, cudaStream_t stream) {
  const int64_t n_ik = (a.t / a.s_q) * a.s_kv * kIndexHeadDim;
  if (a.d_ik_fixed != nullptr) {
    // Deterministic: one 64-bit fixed-point sum per element, in any order, then d_ik from it.
    cudaError_t e = cudaMemsetAsync(a.d_ik_fixed, 0, size_t(n_ik) * 8, stream);
    if (e != cudaSuccess) return e;
    e = cudaMemsetAsync(a.d_ik_nonfinite, 0, size_t(n_ik / kIndexHeadDim) * 4, stream);
    if (e != cudaSuccess) return e;
    if (a.t > 0) {
      // Experiments: JAX_DSA_KL_DET_BULK=1, the sparse form at <= 32 index heads sends bulk u64
      // reductions (otherwise scalar ones); with JAX_DSA_KL_SORT_WAVES=1 as well, sorted slots
      // and wave launches once the fixed-point accumulator outgrows L2.
      const bool bulk = EnvIs("JAX_DSA_KL_DET_BULK", "1") && a.h_i <= 32;
      const bool sort = bulk && SortWaves(n_ik / kIndexHeadDim, 8 * kIndexHeadDim);
      e = a.index_lse != nullptr ? LaunchBwdWgHi<64, false, true, false, true>(a, stream)
          : sort                 ? LaunchBwdWgHi<32, true, false, false, true, true>(a, stream)
          : bulk                 ? LaunchBwdWgHi<32, true, false, false, true>(a, stream)
                                 : LaunchBwdWgHi<64, false, false, false, true>(a, stream);
      if (e != cudaSuccess) return e;
    }
    if (n_ik == 0) return cudaSuccess;
    FixedToFloatKernel<<<unsigned(std::min<int64_t>((n_ik + 255) / 256, 4096)), 256, 0, stream>>>(
        a.d_ik_fixed, a.d_ik_nonfinite, a.fixed_scale, a.d_ik, n_ik);
    return cudaGetLastError();
  }
  const size_t bytes = size_t(n_ik) * sizeof(float);
  cudaError_t e = cudaMemsetAsync(a.d_ik, 0, bytes, stream);
  if (e != cudaSuccess || a.t == 0) return e;
  // At <= 32 index heads the bulk reductions; above, red.v4 atomics (measured faster there).
  // The dense form at <= 32 index heads: two rows a CTA, their heads stacked as 64.
  if (a.index_lse != nullptr) {
    if (a.h_i > 32) return LaunchBwdWgHi<64, false, true>(a, stream);
    return LaunchBwdWgHi<64, true, true, true>(a, stream);
  }
  if (a.h_i <= 32 && SortWaves(n_ik / kIndexHeadDim, 4 * kIndexHeadDim))
    return LaunchBwdWgHi<32, true, false, false, false, true>(a, stream);  // experiment, above
  return a.h_i <= 32 ? LaunchBwdWgHi<32, true>(a, stream) : LaunchBwdWgHi<64, false>(a, stream);
}

}  // namespace indexer_kl
}  // namespace jax_dsa
