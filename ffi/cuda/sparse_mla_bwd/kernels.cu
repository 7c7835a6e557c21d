// jax_dsa's own SM90 sparse-MLA backward (contract: launch.h). Plain CUDA C++, wgmma through
// cuda/common/sm90_wgmma.h; CUB (CUDA toolkit) for the deterministic mode's radix sort and scan.
//
// Kernels, in launch order:
//   PrepKernel      one warp per (query, head): delta = rowsum(out * dout) over d_v, the
//                   sink-merged lse in base 2 (lse2 = log2(e) * logaddexp(lse, sink)), and the
//                   d_attn_sink term dsp = -p_sink * delta (0 without a sink or for an empty row).
//   DsinkKernel     one CTA per head: d_attn_sink[h] = sum over queries of dsp, in a fixed order
//                   (strided per-thread sums, then a fixed tree): deterministic in both modes.
//   MainKernelWs    one CTA (3 warpgroups, 384 threads) per query; for each 64-head tile (one
//                   for H 64, two one after the other for H 128) and each 64-slot block:
//                     a producer WG gathers the block's kv rows (cp.async 16 B, zero rows for
//                     invalid slots; Q and dO once a head tile)
//                     consumer A: S = Q K^T and dP = dO V^T [64 heads x 64 slots] (m64n64),
//                          P = exp2(S * scale * log2e - lse2), dS = scale * P * (dP - delta),
//                          both masked to the valid slots, to shared memory as bf16;
//                          dQ[:, :256] += dS K in registers
//                     consumer B: dQ[:, 256:512] += dS K (D 576: + the rope columns as
//                          dQr^T = K_rope^T dS^T), then dKV = dS^T Q + P^T dO [64 slots x 64
//                          columns] per column chunk, red.global.add.v4.f32 in whole 128-byte
//                          lines into the fp32 accumulator (DET = false; columns permuted
//                          within each chunk, FakeCol) or stored as partial rows (DET = true)
//                   handing off through mbarriers, so that B's reductions of block n run under
//                   the gather and A's MMAs of block n + 1 (details above the kernel).
//                   Atomic mode: one launch a wave of queries once dKV outgrows L2 (AtomicWave).
//   KeysKernel / cub scan / cub radix sort / ReduceKernel   (deterministic mode, per chunk)
//   ConvertKernel   fp32 accumulator -> bf16 dkv.
//
// Deterministic mode. Queries are processed in chunks of C (SparseMlaBwdChunkQueries). For a
// chunk starting at query t0, pair id p = (t - t0) * K + j for slot j of query t. Per chunk:
//   1. KeysKernel: key[p] = kv row of the pair if it is valid (j < topk_length[t], row in
//      range), else S_kv (sorted past every real row, never read); value[p] = p; and an integer
//      histogram counts[row] (atomicAdd on integers: exact, order-free).
//   2. cub::DeviceScan::ExclusiveSum(counts) -> offsets[S_kv + 1]: row r's segment.
//   3. cub::DeviceRadixSort::SortPairs (LSD, stable) on (key, value): since the input is in
//      ascending p, each row's segment lists its pair ids in ascending (query, slot) order.
//   4. MainKernelWs<DET>: the 64-head-summed dKV row of every valid pair is
//      stored (bf16, D values) at partial[p]; at H 128 the CTA does head tile 0 then head tile 1,
//      the second adding its rows into the same partial rows (same thread, same address:
//      partial = bf16(bf16(tile0) + tile1)).
//   5. ReduceKernel: one warp per kv row walks its segment in order, acc = (((0 + x_p0) + x_p1)
//      + ...), then accum[row] += acc. Chunks run in order on one stream.
// Every floating-point sum therefore has a fixed order (and the MMAs are deterministic), so the
// outputs are bitwise reproducible for a given chunk size and device.

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/sm90_wgmma.h"
#include "cuda/sparse_mla_bwd/launch.h"

namespace jax_dsa {
namespace sparse_mla_bwd {
namespace {

using bf16 = __nv_bfloat16;

// The deterministic mode's partial dKV rows: bf16 (half the bytes of fp32 streamed through HBM,
// one more rounding per (query, row), two at H 128, before the fp32 sum: dkv's relative error
// 2.8-3.1e-3 against fp32 atomics' 2.3e-3, and 16-26% faster; benchmarks/notes/
// sparse_mla_bwd.md), or fp32 when built with JAX_DSA_BWD_PARTIAL_BF16=0 (the selftest only: the
// glue's workspace formula assumes bf16).
#ifndef JAX_DSA_BWD_PARTIAL_BF16
#define JAX_DSA_BWD_PARTIAL_BF16 1
#endif
using Partial = std::conditional_t<JAX_DSA_BWD_PARTIAL_BF16 != 0, bf16, float>;

// Experiment (session 39, not yet measured; benchmarks/notes/sparse_mla_bwd.md): consumer A also
// runs the last JAX_DSA_BWD_ASPLIT dKV chunks of each block, after its dQ, in the registers that
// S and dP free, so that two warpgroups issue the reductions. 0: B runs them all (production).
// (With JAX_DSA_BWD_PARTIAL_BF16=0 as well, the deterministic kernels spill 8-12 bytes.)
#ifndef JAX_DSA_BWD_ASPLIT
#define JAX_DSA_BWD_ASPLIT 0
#endif
static_assert(JAX_DSA_BWD_ASPLIT >= 0 && JAX_DSA_BWD_ASPLIT <= 4, "JAX_DSA_BWD_ASPLIT: 0..4 chunks");

// Experiment (session 40, not yet measured; benchmarks/notes/sparse_mla_bwd.md): consumer B
// arrives on pds_empty (and q_empty) as soon as its last dKV chunk's wgmma has completed, before
// that chunk's reductions, so that A's next P/dS stores run under them. 0: after them.
#ifndef JAX_DSA_BWD_EARLY_RELEASE
#define JAX_DSA_BWD_EARLY_RELEASE 0
#endif

constexpr int kTile = 64;       // heads per tile, slots per block
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// PTX helpers

using sm90::CpAsync16;
using sm90::CpAsync16Zfill;
using sm90::CpAsyncCommit;
using sm90::SmemU32;
template <int N>  // all but the N most recent commit groups of this thread have landed
__device__ __forceinline__ void CpAsyncWaitGroup() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Named barrier `id` over `n` threads (whole warps); id 0 is __syncthreads.
__device__ __forceinline__ void NamedBarSync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// Warpgroup register budget (every warp of the warpgroup executes the same one).
template <int N>
__device__ __forceinline__ void RegAlloc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void RegDealloc() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// L2 eviction priorities: the fp32 dKV accumulator (read-modified-written ~K S_q / S_kv times a
// row) evict_last, Q and dO (read once a query) evict_first: 8.6 % off the atomic mode at 16K
// (benchmarks/notes/sparse_mla_bwd.md, session 35).
__device__ __forceinline__ uint64_t PolicyEvictLast() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t PolicyEvictFirst() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ void RedAddV4(float* p, float4 v, uint64_t pol) {
  asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(p), "f"(v.x),
               "f"(v.y), "f"(v.z), "f"(v.w), "l"(pol)
               : "memory");
}
__device__ __forceinline__ void CpAsync16Hint(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "l"(pol)
               : "memory");
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The value, opaque to the compiler: keeps it from hoisting the (loop-invariant) wgmma
// descriptors of the unrolled MMAs out of the block loop, where they would hold ~140 registers.
__device__ __forceinline__ uint32_t Opaque(uint32_t x) {
  asm volatile("mov.b32 %0, %0;\n" : "+r"(x));
  return x;
}

__device__ __forceinline__ void StShared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// d[32] = A (64 x 16) * B (64 x 16)^T, both from shared memory, scale-d false: d is written,
// never read ("=f"), so its registers are free until this issue (with "+f" the previous chunk's
// values would stay live through the epilogue: 32 registers more at the peak).
template <int TRANS_A, int TRANS_B>
__device__ __forceinline__ void WgMmaSSZero(float (&d)[32], uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %34, %35;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
      : "l"(da), "l"(db), "n"(TRANS_A), "n"(TRANS_B));
}

// ---------------------------------------------------------------------------------------------
// Preprocess: delta, lse2, the sink term.

__global__ void PrepKernel(const bf16* __restrict__ out, const bf16* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ sink,
                           int64_t rows, int h, float* __restrict__ delta,
                           float* __restrict__ lse2, float* __restrict__ dsp) {
  const int lane = threadIdx.x & 31;
  const int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (w >= rows) return;
  const uint4* o = reinterpret_cast<const uint4*>(out + w * kDv);
  const uint4* g = reinterpret_cast<const uint4*>(dout + w * kDv);
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kDv / 8 / 32; ++i) {
    const uint4 a = o[lane + 32 * i], b = g[lane + 32 * i];
    const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 fa = __bfloat1622float2(pa[e]), fb = __bfloat1622float2(pb[e]);
      acc = fmaf(fa.x, fb.x, acc);
      acc = fmaf(fa.y, fb.y, acc);
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) {
    const float l = lse[w], s = sink[w % h];
    float lf, ps;
    if (l == INFINITY || s == -INFINITY) {  // an empty row, or no sink
      lf = l;
      ps = 0.f;
    } else {
      const float m = fmaxf(l, s);
      lf = m + log1pf(expf(-fabsf(l - s)));
      ps = expf(s - lf);
    }
    delta[w] = acc;
    lse2[w] = lf * kLog2e;
    dsp[w] = ps == 0.f ? 0.f : -ps * acc;
  }
}

// d_attn_sink[h] = sum_t dsp[t, h], in a fixed order.
__global__ void DsinkKernel(const float* __restrict__ dsp, int64_t s_q, int h, float* __restrict__ d_sink) {
  __shared__ float red[256];
  const int hh = blockIdx.x;
  float acc = 0.f;
  for (int64_t t = threadIdx.x; t < s_q; t += 256) acc += dsp[t * h + hh];
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int n = 128; n >= 1; n >>= 1) {
    if (int(threadIdx.x) < n) red[threadIdx.x] += red[threadIdx.x + n];
    __syncthreads();
  }
  if (threadIdx.x == 0) d_sink[hh] = red[0];
}

// ---------------------------------------------------------------------------------------------
// The main kernel.

struct MainArgs {
  const bf16* q;
  const bf16* kv;
  const bf16* dout;
  const int32_t* idx;
  const int32_t* len;
  const float* lse2;
  const float* delta;
  float* accum;    // !DET: [s_kv, D] fp32
  Partial* partial;  // DET: [chunk * K, D]
  bf16* dq;
  int64_t s_kv, k, t0;
  int h;
  float scale;
};

// Shared memory (offsets from a 1024-aligned base; every operand region 1024-aligned):
//   Q tile   [64 heads, D]    bf16, D/64 blocks of 64 rows x 128 B (128-byte swizzle)
//   dO tile  [64 heads, 512]  bf16, 8 blocks
//   KV block [64 slots, D]    bf16, D/64 blocks
//   P, dS    [64 heads, 64 slots] bf16, one block each
//   rows[2][64] int32 (this block's, the next block's), lse2[64], delta[64] fp32
template <int D>
struct MainSmem {
  static constexpr int kQ = 0;
  static constexpr int kDo = kQ + kTile * D * 2;
  static constexpr int kKv = kDo + kTile * kDv * 2;
  static constexpr int kP = kKv + kTile * D * 2;
  static constexpr int kDs = kP + kTile * kTile * 2;
  static constexpr int kRows = kDs + kTile * kTile * 2;
  static constexpr int kLse = kRows + 2 * kTile * 4;
  static constexpr int kDelta = kLse + kTile * 4;
  static constexpr int kEnd = kDelta + kTile * 4;
};

// Helpers of the main kernel.

// kv row of slot i of block b of query t: -1 past topk_length or out of [0, s_kv).
__device__ __forceinline__ int BlockRow(const MainArgs& a, int64_t t, int len, int b, int i) {
  const int j = b * kTile + i;
  int r = -1;
  if (j < len) {
    r = a.idx[t * a.k + j];
    if (r < 0 || r >= a.s_kv) r = -1;
  }
  return r;
}

// Deterministic mode: one thread's 8 float4 of a dKV chunk row (RowQuad order) into its partial
// row (first writer stores, later ones add: same thread, same address, a fixed order).
__device__ __forceinline__ void DkvPartStore(const float4 (&v)[8], Partial* part, bool first) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float4 x = v[j];
    if constexpr (std::is_same_v<Partial, float>) {
      float4* d4 = reinterpret_cast<float4*>(part + 8 * j);
      if (!first) {
        const float4 o = *d4;
        x = make_float4(o.x + x.x, o.y + x.y, o.z + x.z, o.w + x.w);
      }
      *d4 = x;
    } else {
      uint2* d2 = reinterpret_cast<uint2*>(part + 8 * j);
      if (!first) {
        const uint2 o = *d2;
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&o.y));
        x = make_float4(lo.x + x.x, lo.y + x.y, hi.x + x.z, hi.y + x.w);
      }
      *d2 = make_uint2(PackBf16(x.x, x.y), PackBf16(x.z, x.w));
    }
  }
}

// Atomic mode: a dKV chunk (64 slots x 64 columns, m64n64 fragment) out in whole 128-byte lines.
// Each warp red.v4 covers 4 rows x 128 B, not the 16 rows x 32 B of RowQuad's order: a quarter
// of the L2 requests, and 16-23% faster (benchmarks/notes/sparse_mla_bwd.md, session 39). Quads
// g and g ^ 1 (lane ^ 4) trade half their values; within a chunk, column n = 8 j + 2 q4 + e sits
// at FakeCol(n) = 32 (j >> 2) + 8 q4 + 2 (j & 3) + e, which ConvertKernel<true> undoes. (The
// deterministic mode keeps RowQuad's natural order: the trade measured 1.4-2.5% slower there.)
__host__ __device__ constexpr int FakeCol(int n) {
  return 32 * (n >> 5) + 8 * ((n >> 1) & 3) + 2 * ((n >> 3) & 3) + (n & 1);
}
// ConvertKernel<true> relies on both: a permutation of a chunk's 64 columns, and column pairs
// (2 m, 2 m + 1) kept adjacent (it reads them as one float2).
constexpr bool FakeColValid() {
  bool seen[64] = {};
  for (int n = 0; n < 64; ++n) {
    const int c = FakeCol(n);
    if (c < 0 || c >= 64 || seen[c] || ((n & 1) && c != FakeCol(n - 1) + 1)) return false;
    seen[c] = true;
  }
  return true;
}
static_assert(FakeColValid(), "FakeCol must permute 64 columns and keep column pairs adjacent");

// Atomic mode: rows_e / rows_o are the kv rows (-1: skip) of this lane pair's even / odd quad's
// slots (+0, +8 for hh); dst: the accumulator at the chunk's column 0 of row 0.
__device__ __forceinline__ void DkvRedLines(const float (&acc)[32], const int (&rows_e)[2], const int (&rows_o)[2],
                                            float* dst, int64_t ld, int q4, bool godd, uint64_t pol) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int l = 0; l < 2; ++l) {
      const int j0 = 4 * l;
      const float4 own = make_float4(acc[4 * j0 + 2 * hh], acc[4 * j0 + 2 * hh + 1], acc[4 * (j0 + 1) + 2 * hh],
                                     acc[4 * (j0 + 1) + 2 * hh + 1]);
      float4 rcv;
      rcv.x = __shfl_xor_sync(0xffffffffu, acc[4 * (j0 + 2) + 2 * hh], 4);
      rcv.y = __shfl_xor_sync(0xffffffffu, acc[4 * (j0 + 2) + 2 * hh + 1], 4);
      rcv.z = __shfl_xor_sync(0xffffffffu, acc[4 * (j0 + 3) + 2 * hh], 4);
      rcv.w = __shfl_xor_sync(0xffffffffu, acc[4 * (j0 + 3) + 2 * hh + 1], 4);
      const int c = 32 * l + 8 * q4;
      // The even quad's row: its own lanes write their values, the odd quad's lanes the traded ones.
      if (rows_e[hh] >= 0) RedAddV4(dst + rows_e[hh] * ld + c + (godd ? 4 : 0), godd ? rcv : own, pol);
      if (rows_o[hh] >= 0) RedAddV4(dst + rows_o[hh] * ld + c + (godd ? 0 : 4), godd ? own : rcv, pol);
    }
}

// Issues dKV chunk c of a block: [64 slots, 64 columns] = dS^T Q_c (+ P^T dO_c below d_v), A and B
// MN-major; the first MMA overwrites acc ("=f": its old values are not live across it).
__device__ __forceinline__ void IssueDkvChunk(float (&acc)[32], int c, uint32_t sDs, uint32_t sP, uint32_t sQ,
                                              uint32_t sDo) {
  using namespace sm90;
  WgFence();
  WgMmaSSZero<1, 1>(acc, WgDescMN(sDs, 8192), WgDescMN(sQ + c * 8192, 8192));
#pragma unroll
  for (int ks = 1; ks < 4; ++ks)
    WgMmaSS<1, 1>(acc, WgDescMN(sDs + ks * 2048, 8192), WgDescMN(sQ + c * 8192 + ks * 2048, 8192), 1);
  if (c < kDv / 64) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      WgMmaSS<1, 1>(acc, WgDescMN(sP + ks * 2048, 8192), WgDescMN(sDo + c * 8192 + ks * 2048, 8192), 1);
  }
  WgCommit();
}

// Where one thread's share of a block's dKV chunks goes.
struct DkvOut {
  float* accum;              // atomic: the fp32 accumulator at row 0, column 0
  Partial* pdst;             // DET: this lane's partial row at its column quad
  int row;                   // DET: this lane's kv row (-1: not stored)
  int rows_e[2], rows_o[2];  // atomic: the kv rows of the lane pair's even / odd quad (-1: skip)
  bool even, godd, first;    // RowQuad's half; the odd quad of the pair; the first head tile
  int q4;
  uint64_t pol;
};

// The DkvOut of a thread of a consumer warpgroup (warp wi, lane 4 g + q4) for block b of query t;
// rows: the block's kv row ids in shared memory.
template <int D, bool DET>
__device__ __forceinline__ DkvOut MakeDkvOut(const MainArgs& a, const int* rows, int64_t t, int b, bool first,
                                             int wi, int g, int q4, uint64_t pol) {
  DkvOut o;
  // DET: RowQuad gives even lanes slot r0, odd lanes r0 + 8, 4 consecutive columns.
  o.even = (q4 & 1) == 0;
  const int slot = 16 * wi + g + (o.even ? 0 : 8);
  o.row = rows[slot];
  o.pdst = DET ? a.partial + ((t - a.t0) * a.k + b * kTile + slot) * D + 2 * (q4 & ~1) : nullptr;
  o.accum = a.accum;
  if constexpr (!DET) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      o.rows_e[hh] = rows[16 * wi + (g & ~1) + 8 * hh];
      o.rows_o[hh] = rows[16 * wi + (g | 1) + 8 * hh];
    }
  }
  o.godd = (g & 1) != 0;
  o.first = first;
  o.q4 = q4;
  o.pol = pol;
  return o;
}

// dKV chunks C0 .. C1 - 1 of a block, chunk C0 already issued into acc0: chunk c + 1's wgmma is
// issued before chunk c's output (red.v4 lines, or DET the partial rows) so that it runs under it.
template <int D, bool DET, int C0, int C1>
__device__ __forceinline__ void RunDkvChunks(float (&acc0)[32], float (&acc1)[32], uint32_t sDs, uint32_t sP,
                                             uint32_t sQ, uint32_t sDo, const DkvOut& o) {
  using namespace sm90;
#pragma unroll
  for (int c = C0; c < C1; ++c) {
    float(&cur)[32] = ((c - C0) & 1) ? acc1 : acc0;
    float(&nxt)[32] = ((c - C0) & 1) ? acc0 : acc1;
    if (c + 1 < C1) {
      IssueDkvChunk(nxt, c + 1, sDs, sP, sQ, sDo);
      WgWait<1>();  // chunk c done, c + 1 in flight under the epilogue
    } else {
      WgWait<0>();
    }
    WgFenceOperand(cur);
    if constexpr (DET) {
      float4 v[8];  // (RowQuad shuffles: every lane, before the branch)
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = RowQuad(cur, j, o.even);
      if (o.row >= 0) DkvPartStore(v, o.pdst + 64 * c, o.first);
    } else {
      DkvRedLines(cur, o.rows_e, o.rows_o, o.accum + 64 * c, D, o.q4, o.godd, o.pol);
    }
  }
}

// A warpgroup's dQ accumulators (m64n64 layout, 4 column blocks cb0 .. cb0 + 3) -> bf16 dq rows
// dst[head * D + column] of the 64-head tile.
template <int D>
__device__ __forceinline__ void StoreDq(bf16* dst, const float (&dq)[4][32], int cb0, int wi, int g, int q4) {
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int hh = 16 * wi + g + 8 * hr, col = 64 * (cb0 + n) + 8 * j + 2 * q4;
        *reinterpret_cast<uint32_t*>(dst + int64_t(hh) * D + col) =
            PackBf16(dq[n][4 * j + 2 * hr], dq[n][4 * j + 2 * hr + 1]);
      }
}

// ---------------------------------------------------------------------------------------------
// The main kernel, warp-specialised: three warpgroups with their own instruction streams so that
// the dKV reductions of block n do not stall the gather and the S/dP MMAs of block n + 1 (v2b in
// benchmarks/notes/sparse_mla_bwd.md; 1.24x faster than two warpgroups in lockstep, measured).
//   WG0 "A"  (224 regs): S = Q K^T, dP = dO V^T (m64n64, all 64 slots), P and dS -> shared
//            memory, dQ[:, 0:256] += dS K (128 fp32 a thread). lse2 / delta from global memory.
//   WG1 "B"  (256 regs): dQ[:, 256:512] += dS K, D 576: dQr^T = K_rope^T dS^T for all 64 heads
//            (32 fp32); then the dKV chunks (dS^T Q_c + P^T dO_c; the rope chunk dS^T Q_8),
//            chunk c + 1's wgmma issued before chunk c's red.v4 / partial-row epilogue.
//   WG2 producer (24 regs): row ids into rows[n & 1], the kv gather (cp.async, zero-filled
//            invalid rows), Q and dO once a head tile.
// Registers: B holds 7 accumulator blocks (dq 4, dqr, 2 dKV = 224) + ~28 scalars; A dq 4 + S +
// dP (192) + ~28; the first MMA of S, dP and each dKV chunk is scale-d 0 with "=f" outputs so
// the previous values are not live across it (with "+f": 32-64 more, spills, and ptxas then
// serialises every wgmma of the kernel, C7512).
// Single kv stage (no shared memory for a second): the producer refills it once A and B have
// both finished reading it (their dQ), so A's S/dP of block n + 1 overlaps B's dKV of block n.
// Blocks are counted over the head tiles, n = ht * nblk + b: each mbarrier below completes one
// phase a block (Q ones: a head tile), so a wait for phase n uses parity n & 1.
//   kv_full   (128: producer) kv block n and rows[n & 1] landed        A, B wait
//   kv_empty  (256: A + B)    both dQs of block n read the kv block      producer waits
//   pds_full  (128: A)        P, dS of block n stored                    B waits
//   pds_empty (128: B)        dKV of block n read P, dS (and Q, dO)      A waits before storing
//   q_full    (128: producer) Q, dO of head tile ht landed               A, B wait
//   q_empty   (256: A + B)    head tile ht's last reads of Q, dO         producer waits
// (JAX_DSA_BWD_ASPLIT > 0: A's own dKV chunks also read P, dS, Q, dO; A stores the next P, dS
// after them and a 128-thread barrier, and arrives on q_empty after them.)
// No phase can run two ahead of a waiter (each refill needs the waiter's own earlier arrival),
// so one parity bit is enough. nblk == 0 uses no barrier at all (dq = 0, uniform over the CTA).

constexpr int kWsThreads = 384;
constexpr int kRegA = 224, kRegB = 256, kRegP = 24;  // 128 x (224 + 256 + 24) = 168 x 384
static_assert(128 * (kRegA + kRegB + kRegP) <= 65536 / kWsThreads / 8 * 8 * kWsThreads,
              "setmaxnreg budget above the launch allocation");

template <int D>
struct WsSmem {
  enum { kKvFull, kKvEmpty, kPdsFull, kPdsEmpty, kQFull, kQEmpty, kNumBars };
  static constexpr int kBar = MainSmem<D>::kEnd;  // after MainSmem's regions (8-byte aligned)
  static constexpr int kEnd = kBar + 8 * kNumBars;
  static constexpr int kBytes = kEnd + 1024;  // + the alignment slack
};

template <int D, bool DET>
__global__ void __launch_bounds__(kWsThreads, 1) MainKernelWs(const MainArgs a) {
  using namespace sm90;
  constexpr int NB = D / 64;       // 64-column blocks of a kv row = dKV chunks (9 or 8)
  constexpr bool ROPE = D == 576;  // a 9th column block past d_v
  constexpr int kASplit = JAX_DSA_BWD_ASPLIT;  // dKV chunks of a block that A runs (the last ones)
  using L = MainSmem<D>;
  using W = WsSmem<D>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* base = smem_raw + ((1024 - (SmemU32(smem_raw) & 1023)) & 1023);
  const uint32_t s_base0 = SmemU32(base);
  int* rows = reinterpret_cast<int*>(base + L::kRows);  // (MainSmem's lse / delta: unused here)
  const uint32_t kv_full = s_base0 + W::kBar + 8 * W::kKvFull, kv_empty = s_base0 + W::kBar + 8 * W::kKvEmpty;
  const uint32_t pds_full = s_base0 + W::kBar + 8 * W::kPdsFull, pds_empty = s_base0 + W::kBar + 8 * W::kPdsEmpty;
  const uint32_t q_full = s_base0 + W::kBar + 8 * W::kQFull, q_empty = s_base0 + W::kBar + 8 * W::kQEmpty;

  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, wi = wtid >> 5;
  const int lane = tid & 31, g = lane >> 2, q4 = lane & 3;
  const int64_t t = a.t0 + blockIdx.x;
  int len = a.len[t];
  len = len < 0 ? 0 : (len > a.k ? int(a.k) : len);
  const int nblk = (len + kTile - 1) / kTile;
  const int n_ht = a.h / kTile;

  if (nblk == 0) {  // no valid slot: dq = 0 (every thread returns here; no barrier is used)
    uint4* dst = reinterpret_cast<uint4*>(a.dq + t * a.h * D);
    for (int i = tid; i < a.h * D / 8; i += kWsThreads) dst[i] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  if (tid == 0) {
    MbarInit(kv_full, 128);
    MbarInit(kv_empty, 256);
    MbarInit(pds_full, 128);
    MbarInit(pds_empty, 128);
    MbarInit(q_full, 128);
    MbarInit(q_empty, 256);
  }
  __syncthreads();  // the only CTA-wide barrier: the roles never meet at one again

  if (wg == 2) {
    // ---- Producer. Warp wi copies rows wi, wi + 4, ..; lane = 16-byte chunks lane + 32 m (one
    // row's 512 contiguous bytes a warp instruction): chunk c's offset WgChunk(r, c, 64) is
    // ChunkOff(r, lane) + m * 4 * 8192 (c >> 3 = (lane >> 3) + 4 m, c & 7 = lane & 7).
    RegDealloc<kRegP>();
    const uint64_t pol_first = PolicyEvictFirst();
    auto ChunkOff = [](int r, int ln) { return uint32_t((ln >> 3) * 8192 + r * 128 + (((ln ^ r) & 7) << 4)); };
    const uint32_t sQ = s_base0 + L::kQ, sDo = s_base0 + L::kDo, sKv = s_base0 + L::kKv;
    for (int ht = 0; ht < n_ht; ++ht) {
      for (int b = 0; b < nblk; ++b) {
        const int n = ht * nblk + b;
        const int row = wtid < kTile ? BlockRow(a, t, len, b, wtid) : -1;  // loaded early
        if (n > 0) MbarWait(kv_empty, (n - 1) & 1);  // A and B are done with block n - 1's kv
        int* rw = rows + (n & 1) * kTile;  // (block n - 2's: B read it before kv_empty(n - 1))
        if (wtid < kTile) rw[wtid] = row;
        NamedBarSync(1, 128);  // rw complete for the whole producer
#pragma unroll 1
        for (int r = wi; r < kTile; r += 4) {
          const int kr = rw[r];
          const bf16* src = a.kv + int64_t(kr < 0 ? 0 : kr) * D + lane * 8;
          const uint32_t dst = sKv + ChunkOff(r, lane);
#pragma unroll
          for (int m = 0; m < NB / 4; ++m) CpAsync16Zfill(dst + m * 4 * 8192, src + m * 256, kr >= 0);
          if (ROPE && lane < 8) CpAsync16Zfill(dst + 8 * 8192, src + 512, kr >= 0);
        }
        CpAsyncCommit();
        if (b == 0) {  // the head tile's Q, dO (after the tile's first gather is issued)
          if (ht > 0) MbarWait(q_empty, (ht - 1) & 1);
          const int64_t head0 = t * a.h + ht * kTile;
#pragma unroll 1
          for (int r = wi; r < kTile; r += 4) {
            const bf16* qs = a.q + (head0 + r) * D + lane * 8;
            const bf16* ds = a.dout + (head0 + r) * kDv + lane * 8;
            const uint32_t off = ChunkOff(r, lane);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              CpAsync16Hint(sQ + off + m * 4 * 8192, qs + m * 256, pol_first);
              CpAsync16Hint(sDo + off + m * 4 * 8192, ds + m * 256, pol_first);
            }
            if (ROPE && lane < 8) CpAsync16Hint(sQ + off + 8 * 8192, qs + 512, pol_first);
          }
          CpAsyncCommit();
          CpAsyncWaitGroup<1>();  // the kv group
          FenceProxyAsync();
          MbarArrive(kv_full);
          CpAsyncWaitGroup<0>();
          FenceProxyAsync();
          MbarArrive(q_full);
        } else {
          CpAsyncWaitGroup<0>();
          FenceProxyAsync();  // generic-proxy (cp.async) writes before the wgmma reads
          MbarArrive(kv_full);
        }
      }
    }
    return;
  }

  const float scale = a.scale;
  if (wg == 0) {
    // ---- Consumer A: S, dP, P, dS, dQ[:, 0:256].
    RegAlloc<kRegA>();
    const float sl2 = scale * kLog2e;
    const uint64_t pol_a = (DET || kASplit == 0) ? 0 : PolicyEvictLast();
    float dq[4][32];
    for (int ht = 0; ht < n_ht; ++ht) {
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int i = 0; i < 32; ++i) dq[n][i] = 0.f;
      // lse2, delta of this thread's heads 16 wi + g (+ 8), straight from global memory.
      float l2[2], dl[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int64_t row = t * a.h + ht * kTile + 16 * wi + g + 8 * hr;
        l2[hr] = a.lse2[row];
        dl[hr] = a.delta[row];
      }
      MbarWait(q_full, ht & 1);
      for (int b = 0; b < nblk; ++b) {
        const int n = ht * nblk + b;
        MbarWait(kv_full, n & 1);
        const uint32_t s_base = Opaque(s_base0);
        const uint32_t sQ = s_base + L::kQ, sDo = s_base + L::kDo, sKv = s_base + L::kKv;
        const uint32_t sP = s_base + L::kP, sDs = s_base + L::kDs;
        float sacc[32], pacc[32];  // [head 16 wi + g (+8)][slot 8 j + 2 q4 (+1)]
        // (The first MMA of each overwrites: last block's values are dead, their registers free.)
        WgFence();
        WgMmaSSZero<0, 0>(sacc, WgDesc(sQ), WgDesc(sKv));
#pragma unroll
        for (int ks = 1; ks < 4; ++ks) WgMmaSS<0, 0>(sacc, WgDesc(sQ + ks * 32), WgDesc(sKv + ks * 32), 1);
#pragma unroll 1
        for (int kb = 1; kb < NB; ++kb)
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            WgMmaSS<0, 0>(sacc, WgDesc(sQ + kb * 8192 + ks * 32), WgDesc(sKv + kb * 8192 + ks * 32), 1);
        WgCommit();
        WgMmaSSZero<0, 0>(pacc, WgDesc(sDo), WgDesc(sKv));
#pragma unroll
        for (int ks = 1; ks < 4; ++ks) WgMmaSS<0, 0>(pacc, WgDesc(sDo + ks * 32), WgDesc(sKv + ks * 32), 1);
#pragma unroll 1
        for (int kb = 1; kb < kDv / 64; ++kb)
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            WgMmaSS<0, 0>(pacc, WgDesc(sDo + kb * 8192 + ks * 32), WgDesc(sKv + kb * 8192 + ks * 32), 1);
        WgCommit();
        // Valid slots of this thread's columns: bit 2 j + e for slot 8 j + 2 q4 + e.
        const int* cur = rows + (n & 1) * kTile;
        uint32_t vm = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int2 r2 = *reinterpret_cast<const int2*>(cur + 8 * j + 2 * q4);
          vm |= (uint32_t(r2.x >= 0) << (2 * j)) | (uint32_t(r2.y >= 0) << (2 * j + 1));
        }
        WgWait<1>();  // S (dP still running)
        WgFenceOperand(sacc);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 4 * j + 2 * hr + e;
              sacc[i] = (vm >> (2 * j + e)) & 1 ? exp2f(fmaf(sacc[i], sl2, -l2[hr])) : 0.f;
            }
        WgWait<0>();  // (ptxas places both waits before the exp2s anyway: ~0.1 us a block)
        WgFenceOperand(pacc);
        if (kASplit == 0 && b == nblk - 1) MbarArrive(q_empty);  // this tile's Q, dO reads are done
        uint32_t pk[16], dk[16];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int i = 4 * j + 2 * hr;
            float d2[2];
#pragma unroll
            for (int e = 0; e < 2; ++e)
              d2[e] = (vm >> (2 * j + e)) & 1 ? scale * sacc[i + e] * (pacc[i + e] - dl[hr]) : 0.f;
            pk[2 * j + hr] = PackBf16(sacc[i], sacc[i + 1]);
            dk[2 * j + hr] = PackBf16(d2[0], d2[1]);
          }
        if (n > 0) MbarWait(pds_empty, (n - 1) & 1);  // B's dKV of block n - 1 read P, dS
        // ASPLIT: every A warp's share of its own chunk MMAs of block n - 1 is done too.
        if constexpr (kASplit > 0) NamedBarSync(2, 128);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int hh = 16 * wi + g + 8 * hr;
            const uint32_t off = hh * 128 + ((j ^ (hh & 7)) << 4) + 4 * q4;
            StShared32(sP + off, pk[2 * j + hr]);
            StShared32(sDs + off, dk[2 * j + hr]);
          }
        FenceProxyAsync();
        MbarArrive(pds_full);
        NamedBarSync(2, 128);  // all of A's dS stored before A's own wgmma reads it
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) WgFenceOperand(dq[nn]);
        WgFence();
#pragma unroll
        for (int nn = 0; nn < 4; ++nn)
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            WgMmaSS<0, 1>(dq[nn], WgDesc(sDs + ks * 32), WgDescMN(sKv + nn * 8192 + ks * 2048, 8192), 1);
        WgCommit();
        WgWait<0>();
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) WgFenceOperand(dq[nn]);
        MbarArrive(kv_empty);
        if constexpr (kASplit > 0) {  // A's dKV chunks (its P, dS stay until its own next store)
          const DkvOut out = MakeDkvOut<D, DET>(a, cur, t, b, ht == 0, wi, g, q4, pol_a);
          float acc0[32], acc1[32];
          IssueDkvChunk(acc0, NB - kASplit, sDs, sP, sQ, sDo);
          RunDkvChunks<D, DET, NB - kASplit, NB>(acc0, acc1, sDs, sP, sQ, sDo, out);
          if (b == nblk - 1) MbarArrive(q_empty);  // this tile's Q, dO reads are done
        }
      }
      StoreDq<D>(a.dq + (t * a.h + ht * kTile) * D, dq, 0, wi, g, q4);
    }
    return;
  }

  // ---- Consumer B: dQ[:, 256:512] (+ the rope columns), the dKV chunks and their reductions.
  RegAlloc<kRegB>();
  float dq[4][32];
  float dqr[ROPE ? 32 : 1];  // dQ^T [rope column 16 wi + g (+8)][head 8 j + 2 q4 (+1)]
  float acc0[32], acc1[32];  // dKV chunks, double-buffered
  // DET's dKV rows: RowQuad gives even lanes slot r0, odd lanes r0 + 8, 4 consecutive columns.
  const bool even = (q4 & 1) == 0;
  const int slot = 16 * wi + g + (even ? 0 : 8);
  const int colq = 2 * (q4 & ~1);
  const uint64_t pol_last = DET ? 0 : PolicyEvictLast();
  for (int ht = 0; ht < n_ht; ++ht) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int i = 0; i < 32; ++i) dq[n][i] = 0.f;
#pragma unroll
    for (int i = 0; i < (ROPE ? 32 : 1); ++i) dqr[i] = 0.f;
    MbarWait(q_full, ht & 1);
    for (int b = 0; b < nblk; ++b) {
      const int n = ht * nblk + b;
      MbarWait(kv_full, n & 1);  // (implied by pds_full; waited for the kv proxy fence's sake)
      MbarWait(pds_full, n & 1);
      const uint32_t s_base = Opaque(s_base0);
      const uint32_t sQ = s_base + L::kQ, sDo = s_base + L::kDo, sKv = s_base + L::kKv;
      const uint32_t sP = s_base + L::kP, sDs = s_base + L::kDs;
      // DET: this lane's slot and its partial row; atomic: the kv rows of this lane pair's even /
      // odd quad (slots +0, +8).
      const int row = rows[(n & 1) * kTile + slot];
      Partial* pdst = DET ? a.partial + ((t - a.t0) * a.k + b * kTile + slot) * D + colq : nullptr;
      int rows_e[2], rows_o[2];
      if constexpr (!DET) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          rows_e[hh] = rows[(n & 1) * kTile + 16 * wi + (g & ~1) + 8 * hh];
          rows_o[hh] = rows[(n & 1) * kTile + 16 * wi + (g | 1) + 8 * hh];
        }
      }

#pragma unroll
      for (int nn = 0; nn < 4; ++nn) WgFenceOperand(dq[nn]);
      if constexpr (ROPE) WgFenceOperand(dqr);
      WgFence();
#pragma unroll
      for (int nn = 0; nn < 4; ++nn)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          WgMmaSS<0, 1>(dq[nn], WgDesc(sDs + ks * 32), WgDescMN(sKv + (4 + nn) * 8192 + ks * 2048, 8192), 1);
      if constexpr (ROPE) {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          WgMmaSS<1, 0>(dqr, WgDescMN(sKv + 8 * 8192 + ks * 2048, 8192), WgDesc(sDs + ks * 32), 1);
      }
      WgCommit();
      IssueDkvChunk(acc0, 0, sDs, sP, sQ, sDo);
      WgWait<1>();  // dQ done: B's reads of the kv block are over
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) WgFenceOperand(dq[nn]);
      if constexpr (ROPE) WgFenceOperand(dqr);
      MbarArrive(kv_empty);

      // (The same loop as RunDkvChunks, kept inline: through MakeDkvOut / RunDkvChunks ptxas
      // spills 28 bytes in the D 512 atomic kernel, and the production build is as measured.)
#pragma unroll
      for (int c = 0; c < NB - kASplit; ++c) {
        float(&cur)[32] = (c & 1) ? acc1 : acc0;
        float(&nxt)[32] = (c & 1) ? acc0 : acc1;
        if (c + 1 < NB - kASplit) {
          IssueDkvChunk(nxt, c + 1, sDs, sP, sQ, sDo);
          WgWait<1>();  // chunk c done, c + 1 in flight under the epilogue
        } else {
          WgWait<0>();
          if constexpr (JAX_DSA_BWD_EARLY_RELEASE != 0) {  // B's last shared-memory read is done
            MbarArrive(pds_empty);
            if (b == nblk - 1) MbarArrive(q_empty);
          }
        }
        WgFenceOperand(cur);
        if constexpr (DET) {
          float4 v[8];  // (RowQuad shuffles: every lane, before the branch)
#pragma unroll
          for (int j = 0; j < 8; ++j) v[j] = RowQuad(cur, j, even);
          if (row >= 0) DkvPartStore(v, pdst + 64 * c, ht == 0);
        } else {
          DkvRedLines(cur, rows_e, rows_o, a.accum + 64 * c, D, q4, (g & 1) != 0, pol_last);
        }
      }
      if constexpr (JAX_DSA_BWD_EARLY_RELEASE == 0) {
        MbarArrive(pds_empty);  // every dKV wgmma (P, dS, Q, dO reads) has completed
        if (b == nblk - 1) MbarArrive(q_empty);
      }
    }
    bf16* dqt = a.dq + (t * a.h + ht * kTile) * D;
    StoreDq<D>(dqt, dq, 4, wi, g, q4);
    if constexpr (ROPE) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = kDv + 16 * wi + g + 8 * hr, hh = 8 * j + 2 * q4 + e;
            dqt[int64_t(hh) * D + col] = __float2bfloat16(dqr[4 * j + 2 * hr + e]);
          }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic mode's CSR and reduction; the conversion.

__global__ void KeysKernel(const int32_t* __restrict__ idx, const int32_t* __restrict__ len,
                           int64_t t0, int64_t k, int64_t n, int64_t s_kv, uint32_t* __restrict__ keys,
                           uint32_t* __restrict__ vals, uint32_t* __restrict__ counts) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = t0 + p / k, j = p % k;
    int64_t r = -1;
    if (j < len[t]) {
      r = idx[t * k + j];
      if (r < 0 || r >= s_kv) r = -1;
    }
    keys[p] = r < 0 ? uint32_t(s_kv) : uint32_t(r);
    vals[p] = uint32_t(p);
    if (r >= 0) atomicAdd(&counts[r], 1u);
  }
}

// One warp a kv row: its chunk partials summed in segment (= ascending pair id) order, then added
// to the accumulator.
template <int D>
__global__ void ReduceKernel(const uint32_t* __restrict__ off, const uint32_t* __restrict__ pids,
                             const Partial* __restrict__ partial, float4* __restrict__ accum, int64_t s_kv) {
  constexpr int V = D / 4, NV = (V + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= s_kv) return;
  const uint32_t beg = off[row], end = off[row + 1];
  if (beg == end) return;
  float4 acc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (uint32_t b0 = beg; b0 < end; b0 += 32) {
    const int n = int(end - b0 < 32u ? end - b0 : 32u);
    const uint32_t mine = lane < n ? pids[b0 + lane] : 0u;
    for (int i = 0; i < n; ++i) {
      const uint32_t pid = __shfl_sync(0xffffffffu, mine, i);
      const Partial* src = partial + int64_t(pid) * D;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        const int c = lane + 32 * v;
        if (c < V) {
          float4 x;
          if constexpr (std::is_same_v<Partial, float>) {
            x = __ldcs(reinterpret_cast<const float4*>(src) + c);
          } else {
            const uint2 u = __ldcs(reinterpret_cast<const uint2*>(src) + c);
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
            x = make_float4(lo.x, lo.y, hi.x, hi.y);
          }
          acc[v].x += x.x;
          acc[v].y += x.y;
          acc[v].z += x.z;
          acc[v].w += x.w;
        }
      }
    }
  }
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    const int c = lane + 32 * v;
    if (c < V) {
      float4 o = accum[row * V + c];
      o.x += acc[v].x;
      o.y += acc[v].y;
      o.z += acc[v].z;
      o.w += acc[v].w;
      accum[row * V + c] = o;
    }
  }
}

template <bool FAKE>
__global__ void ConvertKernel(const float4* __restrict__ accum, uint2* __restrict__ dkv, int64_t n4) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 v;
    if constexpr (FAKE) {  // natural columns 4u .. 4u + 3 of a chunk: two float2 in DkvRedLines' order
      const float* c = reinterpret_cast<const float*>(accum + (i & ~int64_t(15)));
      const int n = 4 * int(i & 15);
      const float2 lo = *reinterpret_cast<const float2*>(c + FakeCol(n));
      const float2 hi = *reinterpret_cast<const float2*>(c + FakeCol(n + 2));
      v = make_float4(lo.x, lo.y, hi.x, hi.y);
    } else {
      v = accum[i];
    }
    dkv[i] = make_uint2(PackBf16(v.x, v.y), PackBf16(v.z, v.w));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

constexpr size_t kAlign = 256;
size_t Up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

int KeyBits(int64_t s_kv) {  // bits for keys 0 .. s_kv (s_kv = the invalid sentinel)
  int b = 1;
  while ((int64_t(1) << b) <= s_kv) ++b;
  return b;
}

// The scratch reserved for CUB's sort and scan: a closed form (no CUDA runtime, so that the JAX
// glue can size the workspace when tracing, jax_dsa/ops/sparse_mla/cuda.py), checked against
// CUB's own request at every launch. CUB 3's onesweep sort of n pairs asks for well under one
// byte an item at these sizes; 4 bytes an item + 1 MiB leaves a margin.
size_t CubTempBound(int64_t n, int64_t s_kv) {
  return (size_t(1) << 20) + size_t(n) * 4 + size_t(s_kv + 1) * 4;
}

struct Layout {
  size_t delta = 0, lse2 = 0, dsp = 0, accum = 0;
  size_t partial = 0, keys0 = 0, keys1 = 0, vals0 = 0, vals1 = 0, counts = 0, offsets = 0, temp = 0;
  size_t temp_bytes = 0, total = 0;
  int64_t chunk = 0;
};

bool Supported(int64_t h, int64_t d) { return (h == 64 || h == 128) && (d == 576 || d == 512); }

cudaError_t MakeLayout(int64_t s_q, int64_t s_kv, int64_t h, int64_t d, int64_t k, bool det,
                       int64_t chunk_queries, Layout& L) {
  size_t o = 0;
  auto take = [&](size_t bytes) {
    const size_t at = o;
    o += Up(bytes);
    return at;
  };
  const size_t stats = size_t(s_q) * size_t(h) * 4;
  L.delta = take(stats);
  L.lse2 = take(stats);
  L.dsp = take(stats);
  L.accum = take(size_t(s_kv) * size_t(d) * 4);
  if (det) {
    L.chunk = SparseMlaBwdChunkQueries(s_q, d, k, chunk_queries);
    const int64_t n = L.chunk * k;
    if (n > INT32_MAX || s_kv + 1 > INT32_MAX) return cudaErrorInvalidValue;
    L.partial = take(size_t(n) * size_t(d) * sizeof(Partial));
    L.keys0 = take(size_t(n) * 4);
    L.keys1 = take(size_t(n) * 4);
    L.vals0 = take(size_t(n) * 4);
    L.vals1 = take(size_t(n) * 4);
    L.counts = take(size_t(s_kv + 1) * 4);
    L.offsets = take(size_t(s_kv + 1) * 4);
    L.temp_bytes = CubTempBound(n, s_kv);
    L.temp = take(L.temp_bytes);
  }
  L.total = o;
  return cudaSuccess;
}

// setmaxnreg.inc waits for registers that the producer's .dec released into the CTA's pool: with
// fewer than 168 a thread at launch the consumers would hang, so refuse instead.
template <int D, bool DET>
cudaError_t SetMainSmem() {
  cudaFuncAttributes fa;
  cudaError_t e = cudaFuncGetAttributes(&fa, MainKernelWs<D, DET>);
  if (e != cudaSuccess) return e;
  if (fa.numRegs * kWsThreads < 128 * (kRegA + kRegB + kRegP)) return cudaErrorLaunchOutOfResources;
  return cudaFuncSetAttribute(MainKernelWs<D, DET>, cudaFuncAttributeMaxDynamicSharedMemorySize, WsSmem<D>::kBytes);
}
template <int D, bool DET>
cudaError_t LaunchMain(unsigned grid, const MainArgs& a, cudaStream_t stream) {
  MainKernelWs<D, DET><<<grid, kWsThreads, WsSmem<D>::kBytes, stream>>>(a);
  return cudaGetLastError();
}

// The atomic mode's queries a launch. When the fp32 dKV accumulator exceeds the L2 cache, one
// launch per wave of one-CTA-an-SM queries: the CTAs of a launch then walk their lists (sorted by
// row in the glue) in step, so their reductions and gathers share a narrow row window that stays
// in L2 (at 128K, causal, H100: 649 -> 448 ms; at 16K, where the accumulator fits, the launches'
// tails cost 10 %: one launch; benchmarks/notes/sparse_mla_bwd.md, session 35).
cudaError_t AtomicWave(int64_t s_kv, int64_t d, int64_t& wave) {
  int dev = 0, sms = 0, l2 = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
  if (e != cudaSuccess) return e;
  wave = s_kv * d * 4 > int64_t(l2) && sms > 0 ? sms : INT64_MAX;
  return cudaSuccess;
}

template <int D>
cudaError_t LaunchD(const SparseMlaBwdParams& p, const Layout& L, cudaStream_t stream) {
  char* ws = static_cast<char*>(p.workspace);
  float* delta = reinterpret_cast<float*>(ws + L.delta);
  float* lse2 = reinterpret_cast<float*>(ws + L.lse2);
  float* dsp = reinterpret_cast<float*>(ws + L.dsp);
  float* accum = reinterpret_cast<float*>(ws + L.accum);
  const int h = int(p.h);
  const int64_t rows = p.s_q * p.h;

  PrepKernel<<<unsigned((rows + 7) / 8), 256, 0, stream>>>(
      static_cast<const bf16*>(p.out), static_cast<const bf16*>(p.dout), p.lse, p.attn_sink, rows, h,
      delta, lse2, dsp);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  DsinkKernel<<<h, 256, 0, stream>>>(dsp, p.s_q, h, p.d_sink);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if ((e = cudaMemsetAsync(accum, 0, size_t(p.s_kv) * D * 4, stream)) != cudaSuccess) return e;

  MainArgs a;
  a.q = static_cast<const bf16*>(p.q);
  a.kv = static_cast<const bf16*>(p.kv);
  a.dout = static_cast<const bf16*>(p.dout);
  a.idx = p.indices;
  a.len = p.topk_length;
  a.lse2 = lse2;
  a.delta = delta;
  a.accum = accum;
  a.partial = nullptr;
  a.dq = static_cast<bf16*>(p.dq);
  a.s_kv = p.s_kv;
  a.k = p.k;
  a.t0 = 0;
  a.h = h;
  a.scale = p.sm_scale;

  if (!p.deterministic) {
    if ((e = SetMainSmem<D, false>()) != cudaSuccess) return e;
    int64_t wave = p.wave_queries;
    if (wave <= 0 && (e = AtomicWave(p.s_kv, D, wave)) != cudaSuccess) return e;
    for (int64_t t0 = 0; t0 < p.s_q; t0 += wave) {
      a.t0 = t0;
      const int64_t nq = p.s_q - t0 < wave ? p.s_q - t0 : wave;
      if ((e = LaunchMain<D, false>(unsigned(nq), a, stream)) != cudaSuccess) return e;
    }
  } else {
    if ((e = SetMainSmem<D, true>()) != cudaSuccess) return e;
    a.partial = reinterpret_cast<Partial*>(ws + L.partial);
    uint32_t* keys0 = reinterpret_cast<uint32_t*>(ws + L.keys0);
    uint32_t* keys1 = reinterpret_cast<uint32_t*>(ws + L.keys1);
    uint32_t* vals0 = reinterpret_cast<uint32_t*>(ws + L.vals0);
    uint32_t* vals1 = reinterpret_cast<uint32_t*>(ws + L.vals1);
    uint32_t* counts = reinterpret_cast<uint32_t*>(ws + L.counts);
    uint32_t* offsets = reinterpret_cast<uint32_t*>(ws + L.offsets);
    void* temp = ws + L.temp;
    const int bits = KeyBits(p.s_kv);
    for (int64_t t0 = 0; t0 < p.s_q; t0 += L.chunk) {
      const int64_t nq = p.s_q - t0 < L.chunk ? p.s_q - t0 : L.chunk;
      const int64_t n = nq * p.k;
      if ((e = cudaMemsetAsync(counts, 0, size_t(p.s_kv + 1) * 4, stream)) != cudaSuccess) return e;
      const int64_t kblocks = (n + 255) / 256;
      KeysKernel<<<unsigned(kblocks < 65536 ? kblocks : 65536), 256, 0, stream>>>(
          p.indices, p.topk_length, t0, p.k, n, p.s_kv, keys0, vals0, counts);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
      size_t need = 0;
      if ((e = cub::DeviceScan::ExclusiveSum(nullptr, need, counts, offsets, int(p.s_kv + 1))) != cudaSuccess)
        return e;
      if (need > L.temp_bytes) return cudaErrorInvalidValue;
      size_t tb = L.temp_bytes;
      if ((e = cub::DeviceScan::ExclusiveSum(temp, tb, counts, offsets, int(p.s_kv + 1), stream)) != cudaSuccess)
        return e;
      cub::DoubleBuffer<uint32_t> kb(keys0, keys1), vb(vals0, vals1);
      if ((e = cub::DeviceRadixSort::SortPairs(nullptr, need, kb, vb, int(n), 0, bits)) != cudaSuccess) return e;
      if (need > L.temp_bytes) return cudaErrorInvalidValue;
      tb = L.temp_bytes;
      if ((e = cub::DeviceRadixSort::SortPairs(temp, tb, kb, vb, int(n), 0, bits, stream)) != cudaSuccess)
        return e;
      a.t0 = t0;
      if ((e = LaunchMain<D, true>(unsigned(nq), a, stream)) != cudaSuccess) return e;
      ReduceKernel<D><<<unsigned((p.s_kv + 7) / 8), 256, 0, stream>>>(
          offsets, vb.Current(), a.partial,
          reinterpret_cast<float4*>(accum), p.s_kv);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
  }
  const int64_t n4 = p.s_kv * D / 4;
  const int64_t cblocks = (n4 + 255) / 256;
  const unsigned cgrid = unsigned(cblocks < 65536 ? cblocks : 65536);
  const float4* acc4 = reinterpret_cast<const float4*>(accum);
  uint2* dkv = static_cast<uint2*>(p.dkv);
  if (p.deterministic) {
    ConvertKernel<false><<<cgrid, 256, 0, stream>>>(acc4, dkv, n4);
  } else {
    ConvertKernel<true><<<cgrid, 256, 0, stream>>>(acc4, dkv, n4);
  }
  return cudaGetLastError();
}

}  // namespace

int64_t SparseMlaBwdChunkQueries(int64_t s_q, int64_t d, int64_t k, int64_t chunk_queries) {
  int64_t c = chunk_queries;
  const bool automatic = c <= 0;
  if (automatic) {
    const int64_t budget = int64_t(1) << 31;  // bytes of partial rows a chunk
    c = budget / (k * d * int64_t(sizeof(Partial)));
  }
  if (c > INT32_MAX / k) c = INT32_MAX / k;  // pair ids are 32-bit
  if (c >= s_q) return s_q;
  // Whole waves (one CTA an SM, equal work a query): 455 -> 396 queries at K 2048 / D 576 (fp32
  // partial rows) took the deterministic backward at 16K from 70.0 to 65.1 ms on an H200. A constant, not the
  // device's SM count, so that the summation order is the same on every card.
  constexpr int64_t kWave = 132;
  if (automatic && c > kWave) c = c / kWave * kWave;
  return c < 1 ? 1 : c;
}

size_t SparseMlaBwdWorkspaceBytes(int64_t s_q, int64_t s_kv, int64_t h, int64_t d, int64_t k,
                                  bool deterministic, int64_t chunk_queries) {
  if (!Supported(h, d) || s_q < 1 || s_kv < 1 || k < 1) return 0;
  Layout L;
  if (MakeLayout(s_q, s_kv, h, d, k, deterministic, chunk_queries, L) != cudaSuccess) return 0;
  return L.total;
}

cudaError_t LaunchSparseMlaBwd(const SparseMlaBwdParams& p, cudaStream_t stream) {
  if (!Supported(p.h, p.d) || p.s_q < 1 || p.s_kv < 1 || p.k < 1) return cudaErrorInvalidValue;
  if (p.s_q > INT32_MAX || p.s_kv >= INT32_MAX || p.s_q * p.k > (int64_t(1) << 40)) return cudaErrorInvalidValue;
  if (!p.q || !p.kv || !p.out || !p.dout || !p.lse || !p.attn_sink || !p.indices || !p.topk_length ||
      !p.dq || !p.dkv || !p.d_sink || !p.workspace)
    return cudaErrorInvalidValue;
  // 16 bytes (the float4 accesses; CUB aligns its own scratch): XLA places a custom call's
  // buffers at multiples of 128 bytes only (kXlaAllocatedBufferAlignBytes), not of 256.
  if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0) return cudaErrorInvalidValue;
  Layout L;
  cudaError_t e = MakeLayout(p.s_q, p.s_kv, p.h, p.d, p.k, p.deterministic, p.chunk_queries, L);
  if (e != cudaSuccess) return e;
  if (p.workspace_bytes < L.total) return cudaErrorInvalidValue;
  return p.d == 576 ? LaunchD<576>(p, L, stream) : LaunchD<512>(p, L, stream);
}

}  // namespace sparse_mla_bwd
}  // namespace jax_dsa
