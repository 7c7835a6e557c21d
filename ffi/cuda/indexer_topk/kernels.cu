// The lightning indexer's top-k on SM90 (plain CUDA C++): its kernels and their launch code
// (contract and interface: launch.h; the XLA FFI handlers: handler.cc).

#include "cuda/indexer_topk/launch.h"

#include "cuda/common/relu.h"

#include <cuda_bf16.h>
#include <cub/block/block_radix_sort.cuh>

#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdint>

#include "cuda/common/sm90_wgmma.h"

namespace jax_dsa {
namespace indexer {
namespace {

using namespace sm90;  // NOLINT: the wgmma helpers

constexpr int kD = kTopkHeadDim;
constexpr int kBN = kTopkKeyTile;         // keys per tile
constexpr int kTileBytes = kBN * kD * 2;  // 16 KiB of bf16 keys
constexpr int kTopkThreads = 256;         // a row's CTA of the top-k kernels
constexpr int kTopkCtasPerSm = 4;         // ... four of them an SM
constexpr int kCacheMaxElems = 8192;      // rows up to this many keys: cached in shared memory (32 KiB)
constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------------------------
// PTX helpers

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // src-size 0: zero-fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ int WarpMin(int v) {
  for (int o = 16; o; o >>= 1) v = min(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
__device__ __forceinline__ int WarpMax(int v) {
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
__device__ __forceinline__ unsigned WarpInclusiveSum(unsigned v, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned u = __shfl_up_sync(kFull, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// One step of a reduce-scatter over the lane pairs (lane, lane ^ mask): of x[2N] the lane with the
// mask bit set keeps the upper half, the other the lower, each added to its partner's copy.
template <int N>
__device__ __forceinline__ void ReduceScatterStep(const float (&x)[2 * N], float (&y)[N], int lane, int mask) {
  const bool hi = lane & mask;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float send = hi ? x[i] : x[N + i];
    const float keep = hi ? x[N + i] : x[i];
    y[i] = keep + __shfl_xor_sync(kFull, send, mask);
  }
}

// ---------------------------------------------------------------------------------------------
// (1) Key-tile statistics: min position, min and max segment id of each 64-key tile.

__global__ void TileStatsKernel(const int32_t* __restrict__ kv_pos, const int32_t* __restrict__ kv_seg,
                                int s_kv, int nt, int4* __restrict__ stats) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= nt) return;
  int mn = INT_MAX, smn = INT_MAX, smx = INT_MIN;
  const int s1 = min(j * kBN + kBN, s_kv);
  for (int s = j * kBN; s < s1; ++s) {
    mn = min(mn, kv_pos[s]);
    const int g = kv_seg[s];
    smn = min(smn, g);
    smx = max(smx, g);
  }
  stats[j] = make_int4(mn, smn, smx, 0);
}

// (m, l) <- the merge of two running softmax statistics (max, sum of exp(x - max)).
__device__ __forceinline__ void LseMerge(float& m, float& l, float m2, float l2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  l = l * __expf(m - mx) + l2 * __expf(m2 - mx);
  m = mx;
}

// ---------------------------------------------------------------------------------------------
// The key tiles of a score CTA: the union over its bq rows (from row0) of the 64-key tiles that any
// of them can see (by each tile's min position and segment range), recorded as every row's scanned
// range [lo, hi) in keys; returns this CTA's share [j0, j1) of it (blockIdx.y of gridDim.y).
// Called by all `threads` threads of the CTA (two barriers).
__device__ __forceinline__ int2 CtaTileRange(int row0, int bq, int rows, const int32_t* __restrict__ q_pos,
                                             const int32_t* __restrict__ q_seg,
                                             const int4* __restrict__ stats, int nt,
                                             int2* __restrict__ ranges, int threads) {
  __shared__ int s_lo, s_hi, s_qmax, s_smin, s_smax;
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) {
    int qmax = INT_MIN, smin = INT_MAX, smax = INT_MIN;
    for (int i = 0; i < bq; ++i) {
      if (row0 + i < rows) {
        qmax = max(qmax, q_pos[row0 + i]);
        const int sg = q_seg[row0 + i];
        smin = min(smin, sg);
        smax = max(smax, sg);
      }
    }
    s_qmax = qmax;
    s_smin = smin;
    s_smax = smax;
    s_lo = INT_MAX;
    s_hi = -1;
  }
  __syncthreads();
  {
    const int qmax = s_qmax, smin = s_smin, smax = s_smax;
    int lo = INT_MAX, hi = -1;
    for (int j = tid; j < nt; j += threads) {
      const int4 st = stats[j];
      if (st.x <= qmax && st.y <= smax && st.z >= smin) {
        lo = min(lo, j);
        hi = max(hi, j);
      }
    }
    lo = WarpMin(lo);
    hi = WarpMax(hi);
    if (lane == 0) {
      atomicMin(&s_lo, lo);
      atomicMax(&s_hi, hi);
    }
  }
  __syncthreads();
  int t_lo = s_lo, t_hi = s_hi + 1;
  if (t_hi <= t_lo) t_lo = t_hi = 0;  // no key visible to any of these rows
  if (blockIdx.y == 0 && tid < bq && row0 + tid < rows)
    ranges[row0 + tid] = make_int2(t_lo * kBN, t_hi * kBN);
  const int per = (t_hi - t_lo + int(gridDim.y) - 1) / int(gridDim.y);
  const int j0 = t_lo + int(blockIdx.y) * per;
  return make_int2(j0, min(t_hi, j0 + per));
}

// ---------------------------------------------------------------------------------------------
// (2) Scores of one chunk of query rows on wgmma (SM90's asynchronous warpgroup MMA).
//
// CTA: 3 warpgroups. Warpgroup 0 is the producer: it streams 64-key tiles [64, 128] bf16 into a
// kWgStages-deep ring in shared memory by cp.async and hands each over through an mbarrier, with
// the tile's key positions and segment ids (one 4-byte cp.async a thread), so that the consumers'
// visibility test reads shared memory instead of waiting on global loads after each tile's
// wgmma. Each of
// the two consumer warpgroups owns 128 / H queries (their q as a resident [128, 128] bf16 operand,
// query-major, head minor) and computes the transposed product S^T = K Q^T (m64 n128 k16: 64 keys
// x 128 (query, head) columns) so that a query's heads are the columns of one accumulator row.
// Its accumulators are double-buffered: tile i+1's wgmma runs while tile i's relu, weights and
// head sum are formed. Each thread sums its H / 4 heads of each (key, query) in a fixed order,
// then a reduce-scatter over the 4 lanes of a quad (xor 2, 1): every key's score is formed by the
// same tree (bitwise equal scores for equal keys). Both operands are stored K-major in the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r & 7), 64-column blocks), the layout
// the wgmma descriptors name.
constexpr int kWgThreads = 384;
constexpr int kWgQBytes = 128 * kD * 2;  // one consumer's q: 32 KiB
constexpr int kWgStages = 4;
// Dynamic shared memory: q, the key stages and their positions, + alignment slack.
constexpr int kWgSmem = 1024 + 2 * kWgQBytes + kWgStages * (kTileBytes + 512);

// G = heads / 32. LSE: no scores are stored; each row's running max and sum of exp(score - max)
// over its visible keys go to `scores` read as float2 partials [gridDim.y][rows] (LaunchIndexLse
// merges them).
template <int G, bool LSE = false>
__global__ void __launch_bounds__(kWgThreads, 1)
ScoreKernelWg(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
              const float* __restrict__ w, const int32_t* __restrict__ q_pos,
              const int32_t* __restrict__ q_seg, const int32_t* __restrict__ kv_pos,
              const int32_t* __restrict__ kv_seg, const int4* __restrict__ stats, int nt, int rows,
              int s_kv, int64_t ld, float* __restrict__ scores, int2* __restrict__ ranges) {
  constexpr int STAGES = kWgStages;
  constexpr int H = 32 * G;
  constexpr int QW = 128 / H;       // queries of a consumer warpgroup
  constexpr int BQ = 2 * QW;        // queries of the CTA (8 / G)
  constexpr int NV = 2 * QW;        // (query, key row) sums a thread forms per tile
  constexpr int NO = NV / 4;        // ... and stores after the reduce-scatter
  constexpr int LAG = STAGES - 2;   // tiles the producer keeps in flight beyond the one it hands over
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[STAGES], empty_bar[STAGES];

  const int tid = threadIdx.x, lane = tid & 31;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows (causal) first
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t qbase = SmemAddr(smem);                    // 2 x 32 KiB of q
  const uint32_t kbase = qbase + 2 * kWgQBytes;             // STAGES x 16 KiB of keys
  // STAGES x (64 positions, 64 segment ids) after the keys.
  int* kvmeta = reinterpret_cast<int*>(smem + 2 * kWgQBytes + STAGES * kTileBytes);

  if (tid == 0) {
    for (int i = 0; i < STAGES; ++i) {
      MbarInit(SmemAddr(&full_bar[i]), 128);  // the producer's threads
      MbarInit(SmemAddr(&empty_bar[i]), 256);  // every consumer thread
    }
  }
  // (CtaTileRange's barriers order the initialisation above before any use)
  const int2 jr = CtaTileRange(row0, BQ, rows, q_pos, q_seg, stats, nt, ranges, kWgThreads);
  const int j0 = jr.x, j1 = jr.y;
  float2* partials = reinterpret_cast<float2*>(scores);  // LSE
  if (j0 >= j1) {  // uniform over the CTA
    if (LSE && tid < BQ && row0 + tid < rows)
      partials[int64_t(blockIdx.y) * rows + row0 + tid] = make_float2(-INFINITY, 0.f);
    return;
  }
  const int n = j1 - j0;

  // q of both consumers: rows (query, head) row0 * H + i, zero past the chunk.
  for (int x = tid; x < 2 * 128 * 16; x += kWgThreads) {
    const int cw = x >> 11, r = (x >> 4) & 127, c = x & 15;
    const int qrow = row0 + cw * QW + r / H;
    const bool v = qrow < rows;
    const int64_t src = (int64_t(v ? row0 : 0) * H + (cw * 128 + r) * int(v)) * kD + c * 8;
    CpAsync16(qbase + cw * kWgQBytes + WgChunk(r, c, 128), q + src, v);
  }
  CpAsyncCommit();
  CpAsyncWait<0>();
  FenceProxyAsync();
  __syncthreads();

  const int wg = tid >> 7;
  if (wg == 0) {
    // Producer.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    const int pt = tid;  // 0..127
    for (int it = 0; it < n; ++it) {
      const int st = it % STAGES;
      if (it >= STAGES) MbarWait(SmemAddr(&empty_bar[st]), ((it / STAGES) - 1) & 1);
      const uint32_t dst = kbase + st * kTileBytes;
      const int j = j0 + it;
#pragma unroll
      for (int i = 0; i < (kBN * 16) / 128; ++i) {
        const int x = pt + 128 * i;
        const int r = x >> 4, c = x & 15;
        const int s = j * kBN + r;
        const bool v = s < s_kv;
        CpAsync16(dst + WgChunk(r, c, kBN), k + int64_t(v ? s : 0) * kD + c * 8, v);
      }
      {
        const int s = j * kBN + (pt & 63);
        const bool v = s < s_kv;
        const int32_t* src = (pt < 64 ? kv_pos : kv_seg) + (v ? s : 0);
        const uint32_t d4 = SmemAddr(kvmeta + st * 128 + pt);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d4), "l"(src), "r"(v ? 4 : 0)
                     : "memory");
      }
      CpAsyncCommit();
      if (it >= LAG) {
        CpAsyncWait<LAG>();
        FenceProxyAsync();
        MbarArrive(SmemAddr(&full_bar[(it - LAG) % STAGES]));
      }
    }
    CpAsyncWait<0>();
    FenceProxyAsync();
    for (int it = max(0, n - LAG); it < n; ++it) MbarArrive(SmemAddr(&full_bar[it % STAGES]));
    return;
  }

  // Consumer cw: queries row0 + cw * QW + [0, QW).
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = wg - 1;
  const int ct = tid - 128 * wg;       // 0..127
  const int wq = ct >> 5;              // warp of the warpgroup: key rows 16 wq + [0, 16)
  const int r0 = 16 * wq + (lane >> 2);
  const int quad = lane & 3;
  const int qb0 = row0 + cw * QW;      // this consumer's first query
  // This thread's weights: column n = 8 j8 + 2 quad + e is (query n / H, head n % H).
  float wv[16][2];
#pragma unroll
  for (int j8 = 0; j8 < 16; ++j8)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j8 + 2 * quad + e;
      wv[j8][e] = qb0 + col / H < rows ? w[int64_t(qb0) * H + col] : 0.f;
    }
  // What this lane stores after the reduce-scatter: sums i = quad * NO + m, i = query * 2 + row.
  const int my_q = (quad * NO) >> 1;
  const bool my_ok = qb0 + my_q < rows;
  const int my_rr = my_ok ? qb0 + my_q : 0;
  const int qp = q_pos[my_rr], qs = q_seg[my_rr];
  float* out_row = scores + int64_t(my_rr) * ld;
  const uint32_t qdesc_base = qbase + cw * kWgQBytes;
  float run_m = -INFINITY, run_l = 0.f;  // LSE: this thread's share of query my_q's statistics

  float acc0[64], acc1[64];
  auto issue = [&](float (&acc)[64], int it) {
    const int st = it % STAGES;
    MbarWait(SmemAddr(&full_bar[st]), (it / STAGES) & 1);
    const uint32_t kb = kbase + st * kTileBytes;
    WgFenceOperand(acc);
    WgFence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t off = (ks & 3) * 32;  // 16 columns = 32 bytes along the block
      WgMmaSS<0, 0>(acc, WgDesc(kb + (ks >> 2) * (kBN * 128) + off),
                  WgDesc(qdesc_base + (ks >> 2) * (128 * 128) + off), ks > 0);
    }
    WgCommit();
    WgFenceOperand(acc);
  };
  // Every consumer thread arrives once it has read the stage's positions, so that the producer's
  // refill is ordered after each thread's reads by the mbarrier alone (racecheck, topk_selftest:
  // 0 hazards; one arrival a warp after __syncwarp was reported racy).
  auto release = [&](int it) { MbarArrive(SmemAddr(&empty_bar[it % STAGES])); };
  auto finish = [&](float (&acc)[64], int it) {
    WgFenceOperand(acc);
    const int j = j0 + it;
    int kvp[NO], kvs[NO];
#pragma unroll
    for (int m = 0; m < NO; ++m) {
      const int row = ((quad * NO + m) & 1) ? r0 + 8 : r0;
      const int* meta = kvmeta + (it % STAGES) * 128;
      kvp[m] = meta[row];
      kvs[m] = meta[64 + row];
    }
    release(it);  // the stage's positions are read
    // v[query * 2 + row]: relu, weight, this thread's H / 4 heads in order.
    float v[NV];
#pragma unroll
    for (int qq = 0; qq < QW; ++qq) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float p = 0.f;
#pragma unroll
        for (int j8 = qq * (H / 8); j8 < (qq + 1) * (H / 8); ++j8) {
#pragma unroll
          for (int e = 0; e < 2; ++e) p = fmaf(Relu(acc[4 * j8 + 2 * hr + e]), wv[j8][e], p);
        }
        v[qq * 2 + hr] = p;
      }
    }
    // Reduce-scatter over the quad (lane bits 1, 0).
    constexpr int NV1 = NV / 2;
    float v1[NV1];
    ReduceScatterStep<NV1>(v, v1, lane, 2);
    float fv[NO];
    ReduceScatterStep<NO>(v1, fv, lane, 1);
    if (my_ok) {
      bool vis[NO];
      float tile_m = -INFINITY;
#pragma unroll
      for (int m = 0; m < NO; ++m) {
        const int row = ((quad * NO + m) & 1) ? r0 + 8 : r0;
        const int s = j * kBN + row;
        vis[m] = s < s_kv && kvp[m] <= qp && kvs[m] == qs;
        // Visible: clamp to the lowest finite float (never -inf), -0.0 -> +0.0.
        if constexpr (!LSE) out_row[s] = vis[m] ? fmaxf(fv[m], -FLT_MAX) + 0.f : -INFINITY;
        if (vis[m]) tile_m = fmaxf(tile_m, fv[m]);
      }
      if constexpr (LSE) {
        if (tile_m > run_m) {
          run_l *= __expf(run_m - tile_m);
          run_m = tile_m;
        }
#pragma unroll
        for (int m = 0; m < NO; ++m)
          if (vis[m]) run_l += __expf(fv[m] - run_m);
      }
    }
  };

  // Tile i's wgmma is issued before tile i - 1's epilogue; no branch inside the pipeline.
  issue(acc0, 0);
  int it = 0;
  for (; it + 2 < n; it += 2) {
    issue(acc1, it + 1);
    WgWait<1>();
    finish(acc0, it);
    issue(acc0, it + 2);
    WgWait<1>();
    finish(acc1, it + 1);
  }
  if (it + 1 < n) {
    issue(acc1, it + 1);
    WgWait<1>();
    finish(acc0, it);
    WgWait<0>();
    finish(acc1, it + 1);
  } else {
    WgWait<0>();
    finish(acc0, it);
  }
  if constexpr (LSE) {
    // Merge the shares of each query: lanes with the same query (the 8 row groups; with NO == 1
    // also the lane pair), then the four warps through shared memory.
    __shared__ float2 red[2][4][QW];
#pragma unroll
    for (int mask = 4; mask <= 16; mask <<= 1)
      LseMerge(run_m, run_l, __shfl_xor_sync(kFull, run_m, mask), __shfl_xor_sync(kFull, run_l, mask));
    if constexpr (NO == 1)
      LseMerge(run_m, run_l, __shfl_xor_sync(kFull, run_m, 1), __shfl_xor_sync(kFull, run_l, 1));
    if (lane < 4 && (NO > 1 || (quad & 1) == 0)) red[cw][wq][my_q] = make_float2(run_m, run_l);
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");  // this consumer's 4 warps
    if (ct < QW && qb0 + ct < rows) {
      float m = -INFINITY, l = 0.f;
#pragma unroll
      for (int x = 0; x < 4; ++x) LseMerge(m, l, red[cw][x][ct].x, red[cw][x][ct].y);
      partials[int64_t(blockIdx.y) * rows + qb0 + ct] = make_float2(m, l);
    }
  }
}

// Each row's log-sum-exp from its gy partials (running max, sum of exp(score - max)); -inf for a
// row without visible keys.
__global__ void LseCombineKernel(const float2* __restrict__ partials, int gy, int rows,
                                 float* __restrict__ lse) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float m = -INFINITY, l = 0.f;
  for (int y = 0; y < gy; ++y) LseMerge(m, l, partials[int64_t(y) * rows + r].x, partials[int64_t(y) * rows + r].y);
  lse[r] = l > 0.f ? m + logf(l) : -INFINITY;
}

// ---------------------------------------------------------------------------------------------
// (3) Exact top-k of one row of scores.

// Order-preserving key of a score: 0 for -inf (invisible); a larger float a larger key; -0 = +0.
__device__ __forceinline__ uint32_t ScoreKey(float f) {
  if (f == -INFINITY) return 0u;
  const uint32_t u = __float_as_uint(f == 0.f ? 0.f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The score of a key (ScoreKey's inverse; -inf for 0).
__device__ __forceinline__ float KeyScore(uint32_t k) {
  if (k == 0u) return -INFINITY;
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// hist[bin] += 1 for each lane with `active` (all lanes of the warp call it).
__device__ __forceinline__ void HistAdd(unsigned* hist, unsigned bin, bool active, int lane) {
  const unsigned m = __ballot_sync(kFull, active);
  if (active) {
    const unsigned peers = __match_any_sync(m, bin);
    if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], unsigned(__popc(peers)));
  }
}

struct SelectState {
  unsigned kprime;  // keys selected: min(topk, visible keys)
  unsigned need;    // of the current prefix group, how many are still to take
  unsigned prefix;  // the threshold's bits found so far
  int done;         // 1: select every visible key >= prefix (no ordered tie pass needed)
};

// Index-order scan of one count a thread over an NT-thread block: (the lower threads' sum, the
// block's total). One barrier; wtot alternates between two buffers (par) so that the next call's
// writes do not race this call's reads.
template <int NT>
__device__ __forceinline__ uint2 BlockScanCount(unsigned v, unsigned (&wtot)[2][NT / 32], int& par,
                                                int lane, int warp) {
  const unsigned incl = WarpInclusiveSum(v, lane);
  if (lane == 31) wtot[par][warp] = incl;
  __syncthreads();
  unsigned before = 0, total = 0;
#pragma unroll
  for (int q = 0; q < NT / 32; ++q) {
    const unsigned t = wtot[par][q];
    before += q < warp ? t : 0u;
    total += t;
  }
  par ^= 1;
  return make_uint2(before + incl - v, total);
}

// One radix-select step, by warp 0: of the 256 counts in hist (bin b: the keys of the current
// prefix whose digit at `shift` is b), scanned from the highest bin, the bin holding the need-th
// key. The lane that finds it sets st.prefix = prefix | bin << shift, st.need = need - (keys in
// higher bins) and st.done = (the bin is taken whole). Returns the counts' total.
__device__ __forceinline__ unsigned SelectBin(const unsigned* hist, unsigned prefix, unsigned need,
                                              int shift, int lane, SelectState& st) {
  unsigned c[8];
  unsigned local = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    c[i] = hist[255 - 8 * lane - i];
    local += c[i];
  }
  const unsigned incl = WarpInclusiveSum(local, lane);
  const unsigned excl = incl - local;
  if (excl < need && need <= incl) {  // exactly one lane
    unsigned acc = excl, bin = 0, above = 0, eq = 0;
    bool found = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (!found && acc + c[i] >= need) {
        bin = 255u - 8u * lane - i;
        above = acc;
        eq = c[i];
        found = true;
      }
      acc += c[i];
    }
    st.prefix = prefix | (bin << shift);
    st.need = need - above;
    st.done = eq == need - above;
  }
  return __shfl_sync(kFull, incl, 31);
}

// The selected keys' output: sel[0, kprime) holds (key << 32 | ~index) entries, equal keys in
// index order; CUB's stable block radix sort on the 32-bit keys (descending) orders them, and
// row r of out (and of out_scores, if given) gets the indices (scores), -1 (-inf) past kprime.
template <int NT>
__device__ __forceinline__ void SortWriteSelected(unsigned long long* sel, unsigned kprime, int topk,
                                                  int r, int32_t* __restrict__ out,
                                                  float* __restrict__ out_scores) {
  using BlockSort = cub::BlockRadixSort<uint32_t, NT, kTopkMaxK / NT, uint32_t>;
  static_assert(sizeof(typename BlockSort::TempStorage) <= kTopkMaxK * sizeof(unsigned long long),
                "sort storage in sel");
  constexpr int E = kTopkMaxK / NT;
  const int tid = threadIdx.x;
  __syncthreads();
  uint32_t keys[E], vals[E];
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const unsigned e = unsigned(E * tid + i);
    const unsigned long long x = e < kprime ? sel[e] : 0ull;  // 0: below every selected key
    keys[i] = uint32_t(x >> 32);
    vals[i] = 0xffffffffu - uint32_t(x & 0xffffffffull);
  }
  __syncthreads();  // sel's storage becomes the sort's
  BlockSort(*reinterpret_cast<typename BlockSort::TempStorage*>(sel))
      .SortDescendingBlockedToStriped(keys, vals);
  int32_t* o = out + int64_t(r) * topk;
  float* os = out_scores ? out_scores + int64_t(r) * topk : nullptr;
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const unsigned e = unsigned(tid + NT * i);
    if (e < unsigned(topk)) {
      o[e] = e < kprime ? int32_t(vals[i]) : -1;
      if (os) os[e] = e < kprime ? KeyScore(keys[i]) : -INFINITY;
    }
  }
}

// The top-k of a row of at most kCacheMaxElems keys (TopkRowStride(S_kv) <= 8192): the first pass
// reads the row (four loads a thread in flight) and caches its keys in shared memory, the later
// passes read the cache. kTopkThreads threads a row, kTopkCtasPerSm rows an SM, so that one row's
// barriers and load latencies hide behind the others'. The selected keys are collected in index
// order (a block scan) and sorted by CUB's stable block radix sort on the 32-bit key, so that
// equal keys keep the lower index first.
__global__ void __launch_bounds__(kTopkThreads, kTopkCtasPerSm)
TopkCachedKernel(const float* __restrict__ scores, int64_t ld, const int2* __restrict__ ranges, int topk,
                 int32_t* __restrict__ out, float* __restrict__ out_scores) {
  constexpr int NT = kTopkThreads;
  extern __shared__ uint4 cache4[];  // the row's keys
  __shared__ unsigned hist[256];
  __shared__ __align__(16) unsigned long long sel[kTopkMaxK];
  constexpr int kWarps = NT / 32;
  __shared__ unsigned wtot[2][kWarps];
  __shared__ SelectState st;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = gridDim.x - 1 - blockIdx.x;  // the longest rows (causal) first
  const int2 rg = ranges[r];
  const int lo = rg.x, n = rg.y - rg.x;  // n: a multiple of 64
  const float4* src4 = reinterpret_cast<const float4*>(scores + int64_t(r) * ld + lo);

  auto key4 = [&](int i4, bool first) -> uint4 {
    if (!first) return cache4[i4];
    // One pass over HBM: the row's keys are cached.
    const float4 f = __ldcs(src4 + i4);
    const uint4 kk = make_uint4(ScoreKey(f.x), ScoreKey(f.y), ScoreKey(f.z), ScoreKey(f.w));
    cache4[i4] = kk;
    return kk;
  };
  // fn(i, keys of elements i..i+3) for every thread's 4 elements of the row, in index order
  // tile by tile, four loads a thread before their first use (every thread makes the same calls:
  // elements past the row are 0 = invisible).
  auto sweep = [&](bool first, auto&& fn) {
    constexpr int U = 4;
    for (int base = 0; base < n; base += U * 4 * NT) {
      uint4 kk[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * 4 * NT + 4 * tid;
        kk[u] = i < n ? key4(i >> 2, first) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) fn(base + u * 4 * NT + 4 * tid, kk[u]);
    }
  };

  // Radix select, 8 bits a pass from the top, over the keys of the prefix chosen so far. The
  // first pass reads the row (and caches its keys), counts the visible keys and takes every one
  // of them when there are at most topk. A pass stops the search when the chosen bucket is
  // taken whole (select every key >= prefix); after the fourth the prefix is the exact
  // threshold T and `need` keys equal to T are still to take, the lowest indices first.
  for (int p = 0; p < 4; ++p) {
    if (p > 0 && st.done) break;  // uniform: written before the last barrier
    const int shift = 24 - 8 * p;
    const unsigned hmask = p == 0 ? 0u : 0xffffffffu << (shift + 8);
    const unsigned prefix = p == 0 ? 0u : st.prefix;
    // (read here, by every thread before the barrier below: warp 0 rewrites st after the next)
    const unsigned need = p == 0 ? unsigned(topk) : st.need;
    if (tid < 256) hist[tid] = 0;
    __syncthreads();
    sweep(p == 0, [&](int, const uint4& kk) {
      HistAdd(hist, (kk.x >> shift) & 255u, kk.x != 0 && (kk.x & hmask) == prefix, lane);
      HistAdd(hist, (kk.y >> shift) & 255u, kk.y != 0 && (kk.y & hmask) == prefix, lane);
      HistAdd(hist, (kk.z >> shift) & 255u, kk.z != 0 && (kk.z & hmask) == prefix, lane);
      HistAdd(hist, (kk.w >> shift) & 255u, kk.w != 0 && (kk.w & hmask) == prefix, lane);
    });
    __syncthreads();
    if (warp == 0) {
      const unsigned total = SelectBin(hist, prefix, need, shift, lane, st);
      __syncwarp();
      if (p == 0 && lane == 0) {  // at most topk visible keys: take them all
        const bool take_all = total <= unsigned(topk);
        st.kprime = take_all ? total : unsigned(topk);
        if (take_all) {
          st.prefix = 0;
          st.need = 0;
          st.done = 1;
        }
      }
    }
    __syncthreads();
  }

  // Collect: keys > T all, in slots [0, kprime - need_eq); keys == T the first `need` by index
  // (ordered), unless done (>= T); both kinds in index order.
  const unsigned T = st.prefix;
  const bool ordered = !st.done;
  const unsigned need_eq = ordered ? st.need : 0u;
  const unsigned kprime = st.kprime;
  unsigned running = 0;        // keys == T seen in earlier tiles
  unsigned s_cnt_reg = 0;      // keys > T seen in earlier tiles
  int par = 0;
  auto block_scan = [&](unsigned v) { return BlockScanCount<NT>(v, wtot, par, lane, warp); };
  if (kprime > 0) {
    sweep(false, [&](int i, const uint4& kk) {
      const unsigned kv[4] = {kk.x, kk.y, kk.z, kk.w};
      unsigned gtm = 0, eqm = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool vis = kv[c] != 0;
        const bool gt = vis && (ordered ? kv[c] > T : kv[c] >= T);
        const bool eq = ordered && vis && kv[c] == T;
        gtm |= unsigned(gt) << c;
        eqm |= unsigned(eq) << c;
      }
      const unsigned ngt = __popc(gtm);
      // One block scan of (count > T) | (count == T) << 16.
      const unsigned neq = __popc(eqm);
      const uint2 sc = block_scan(ngt | (neq << 16));
      const unsigned excl = sc.x, tile_total = sc.y;
      unsigned slot = s_cnt_reg + (excl & 0xffffu);
      unsigned rank = running + (excl >> 16);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t idx = uint32_t(lo + i + c);
        const unsigned long long e = (static_cast<unsigned long long>(kv[c]) << 32) | (0xffffffffu - idx);
        if (gtm & (1u << c)) sel[slot++] = e;
        if (eqm & (1u << c)) {
          if (rank < need_eq) sel[kprime - need_eq + rank] = e;
          ++rank;
        }
      }
      s_cnt_reg += tile_total & 0xffffu;
      running += tile_total >> 16;
    });
  }
  SortWriteSelected<NT>(sel, kprime, topk, r, out, out_scores);
}

// The top-k of a longer row: read from global memory twice, whatever its length.
// A row of at least kSampleMinKeys keys first reads kSample evenly spaced keys and takes as its
// floor L the sample's r-th largest key, r = 1.5 * topk * kSample / n, so that about 1.5 * topk
// keys are >= L: keys below it cost a compare, not a shared-memory atomic. Sweep 1 counts the
// top kDigit1Bits bits of the keys >= L (8192 bins); one block scan finds the bin that holds the
// topk-th key. Sweep 2 collects the keys above that bin into sel and the keys in it (the
// candidates, in index order) into the histogram's room, where the remaining 19 bits (8 + 8 + 3)
// are selected without reading the row again. Fallbacks keep it exact: fewer than topk keys
// >= L redo sweep 1 with every visible key; a bin with more than kCandCap keys (many equal
// scores, such as ReLU's zero plateaus) refines over the row, a sweep a digit. Same results as
// TopkCachedKernel (the tie rule included).
constexpr int kDigit1Bits = 13;
constexpr int kDigit1Shift = 32 - kDigit1Bits;
constexpr int kDigit1Bins = 1 << kDigit1Bits;  // 32 KiB of counts, then the candidates' room
constexpr int kCandCap = kDigit1Bins / 2;      // (key, index) pairs in that room
constexpr int kTwoSweepSmem = kDigit1Bins * 4;
constexpr int kSample = 1024;                  // keys sampled for the floor (in sel's room)
constexpr int kSampleMinKeys = 6144;           // rows shorter than this count every key

__global__ void __launch_bounds__(kTopkThreads, kTopkCtasPerSm)
TopkTwoSweepKernel(const float* __restrict__ scores, int64_t ld, const int2* __restrict__ ranges,
                   int topk, int32_t* __restrict__ out, float* __restrict__ out_scores) {
  constexpr int NT = kTopkThreads;
  static_assert(kSample == 4 * NT, "four sampled keys a thread");
  extern __shared__ uint4 dyn4[];
  unsigned* hist1 = reinterpret_cast<unsigned*>(dyn4);  // sweep 1: [kDigit1Bins] counts
  uint2* cand = reinterpret_cast<uint2*>(dyn4);         // sweep 2 on: [kCandCap] (key, index)
  __shared__ unsigned hist[256];
  __shared__ __align__(16) unsigned long long sel[kTopkMaxK];
  uint32_t* sample = reinterpret_cast<uint32_t*>(sel);  // [kSample], before sweep 2
  __shared__ unsigned wtot[2][NT / 32];
  __shared__ SelectState st;
  __shared__ unsigned s_bin, s_eq, s_floor;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = gridDim.x - 1 - blockIdx.x;  // the longest rows (causal) first
  const int2 rg = ranges[r];
  const int lo = rg.x, n = rg.y - rg.x;  // n: a multiple of 64
  const float* src = scores + int64_t(r) * ld + lo;
  const float4* src4 = reinterpret_cast<const float4*>(src);
  int par = 0;
  auto block_scan = [&](unsigned v) { return BlockScanCount<NT>(v, wtot, par, lane, warp); };
  // fn(i, keys of elements i..i+3) for every thread's 4 elements of the row, in index order tile
  // by tile, four loads a thread in flight (elements past the row are 0 = invisible).
  auto sweep = [&](auto&& fn) {
    for (int base = 0; base < n; base += 16 * NT) {
      uint4 kk[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * 4 * NT + 4 * tid;
        float4 f = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        if (i < n) f = __ldcg(src4 + (i >> 2));
        kk[u] = make_uint4(ScoreKey(f.x), ScoreKey(f.y), ScoreKey(f.z), ScoreKey(f.w));
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) fn(base + u * 4 * NT + 4 * tid, kk[u]);
    }
  };
  // Radix select over the keys that src(fn) presents (fn(keys[4], indices[4]) for all of them,
  // 0 = none), from st.prefix / st.need: `passes` digits (shift, bits) until a bin is taken whole.
  auto refine = [&](auto&& src_fn, const int2 (&digits)[4], int passes) {
    for (int p = 0; p < passes; ++p) {
      if (st.done) break;  // uniform: written before the last barrier
      const int shift = digits[p].x;
      const unsigned dmask = (1u << digits[p].y) - 1u;
      const unsigned hmask = unsigned(0xffffffffull << (shift + digits[p].y));
      const unsigned prefix = st.prefix, need = st.need;
      hist[tid & 255] = 0;
      __syncthreads();
      src_fn([&](const uint32_t (&kv)[4], const uint32_t (&)[4]) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
          HistAdd(hist, (kv[c] >> shift) & dmask, kv[c] != 0 && (kv[c] & hmask) == prefix, lane);
      });
      __syncthreads();
      if (warp == 0) SelectBin(hist, prefix, need, shift, lane, st);
      __syncthreads();
    }
  };

  // The floor L: the r-th largest of kSample evenly spaced keys (1: every visible key).
  for (int i = tid; i < kDigit1Bins; i += NT) hist1[i] = 0;
  if (tid == 0) s_floor = 1u;
  if (n >= kSampleMinKeys) {  // uniform
    const int64_t want = (int64_t(3) * topk * kSample + 2 * n - 1) / (2 * n);  // ceil(1.5 topk M / n)
    const unsigned rank = unsigned(want < kSample ? want : kSample);
    unsigned vis = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = tid + c * NT;
      const uint32_t k = ScoreKey(__ldcg(src + int64_t(j) * n / kSample + n / (2 * kSample)));
      sample[j] = k;
      vis += k != 0;
    }
    if (tid == 0) {
      st.prefix = 0;
      st.need = rank;
      st.done = 0;
    }
    const unsigned n_vis = block_scan(vis).y;  // (its barrier publishes sample and st)
    if (rank < n_vis) {  // uniform
      // The top 16 bits suffice: a floor at most 2^-7 (relative) below the rank-th key.
      const int2 digits[4] = {{24, 8}, {16, 8}, {0, 0}, {0, 0}};
      refine([&](auto&& fn) {
        uint32_t kv[4], ix[4] = {0, 0, 0, 0};
#pragma unroll
        for (int c = 0; c < 4; ++c) kv[c] = sample[4 * tid + c];
        fn(kv, ix);
      }, digits, 2);
      // st.prefix <= the rank-th largest sampled key
      if (tid == 0) s_floor = max(st.prefix, 1u);
    }
  }
  __syncthreads();
  unsigned floor_key = s_floor;

  // Sweep 1: the histogram of the top bits of the keys >= L; the bin of the topk-th key.
  for (int attempt = 0; attempt < 2; ++attempt) {
    sweep([&](int, const uint4& kk) {
      if (kk.x >= floor_key) atomicAdd(&hist1[kk.x >> kDigit1Shift], 1u);
      if (kk.y >= floor_key) atomicAdd(&hist1[kk.y >> kDigit1Shift], 1u);
      if (kk.z >= floor_key) atomicAdd(&hist1[kk.z >> kDigit1Shift], 1u);
      if (kk.w >= floor_key) atomicAdd(&hist1[kk.w >> kDigit1Shift], 1u);
    });
    __syncthreads();
    // Thread t sums bins [top - kPer + 1, top], the highest to thread 0 (read rotated by lane:
    // no bank conflicts); the block scan of the sums places the bin of the topk-th key.
    constexpr int kPer = kDigit1Bins / NT;
    static_assert(kPer == 32, "one bin a lane in the rotated read");
    const int top = kDigit1Bins - 1 - kPer * tid;
    unsigned local = 0;
#pragma unroll 8
    for (int j = 0; j < kPer; ++j) local += hist1[top - ((j + lane) & (kPer - 1))];
    const uint2 sc = block_scan(local);
    const unsigned excl = sc.x, total = sc.y;
    if (total < unsigned(topk) && floor_key > 1u) {  // uniform: the floor was too high
      floor_key = 1u;
      for (int i = tid; i < kDigit1Bins; i += NT) hist1[i] = 0;
      __syncthreads();
      continue;
    }
    if (total <= unsigned(topk)) {  // at most topk keys >= L: take them all
      if (tid == 0) {
        st.kprime = total;
        st.done = 1;
        s_bin = 0;
        s_eq = 0;
      }
    } else if (excl < unsigned(topk) && unsigned(topk) <= excl + local) {  // exactly one thread
      unsigned acc = excl;
      for (int j = 0; j < kPer; ++j) {
        const unsigned c = hist1[top - j];
        if (acc + c >= unsigned(topk)) {
          st.kprime = unsigned(topk);
          st.prefix = unsigned(top - j) << kDigit1Shift;
          st.need = unsigned(topk) - acc;
          st.done = c == unsigned(topk) - acc;
          s_bin = unsigned(top - j);
          s_eq = c;
          break;
        }
        acc += c;
      }
    }
    __syncthreads();  // (also: hist1's reads are done before cand overwrites it)
    break;
  }
  const unsigned kprime = st.kprime, bin = s_bin, eq = s_eq;
  const bool done1 = st.done;
  const bool in_smem = !done1 && eq <= unsigned(kCandCap);

  // Sweep 2: the keys >= L above the bin (every one with a digit >= bin when the bin is taken
  // whole) to sel[0, above) and the bin's keys to cand, both in index order.
  unsigned above = 0;
  if (kprime > 0) {
    unsigned n_cand = 0;
    sweep([&](int i, const uint4& kk) {
      const unsigned kv[4] = {kk.x, kk.y, kk.z, kk.w};
      unsigned gtm = 0, cdm = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const unsigned d = kv[c] >> kDigit1Shift;
        const bool in = kv[c] >= floor_key;
        gtm |= unsigned(in && (done1 ? d >= bin : d > bin)) << c;
        cdm |= unsigned(in_smem && in && d == bin) << c;
      }
      const uint2 sc = block_scan(__popc(gtm) | (__popc(cdm) << 16));
      unsigned slot = above + (sc.x & 0xffffu), cslot = n_cand + (sc.x >> 16);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t idx = uint32_t(lo + i + c);
        if (gtm & (1u << c)) sel[slot++] = (static_cast<unsigned long long>(kv[c]) << 32) | (0xffffffffu - idx);
        if (cdm & (1u << c)) cand[cslot++] = make_uint2(kv[c], idx);
      }
      above += sc.y & 0xffffu;
      n_cand += sc.y >> 16;
    });
  }

  if (!done1) {  // uniform: `need` of the bin's `eq` keys are still to take
    // fn(keys, indices) over the bin's keys >= L in index order, four a thread a step (0: none),
    // from cand or, when they did not fit, from the row.
    auto cand_sweep = [&](auto&& fn) {
      if (in_smem) {
        for (int base = 0; base < int(eq); base += 4 * NT) {
          uint32_t kv[4], ix[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int j = base + 4 * tid + c;
            const uint2 e = j < int(eq) ? cand[j] : make_uint2(0u, 0u);
            kv[c] = e.x;
            ix[c] = e.y;
          }
          fn(kv, ix);
        }
      } else {
        sweep([&](int i, const uint4& kk) {
          uint32_t kv[4] = {kk.x, kk.y, kk.z, kk.w}, ix[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            ix[c] = uint32_t(lo + i + c);
            if ((kv[c] >> kDigit1Shift) != bin || kv[c] < floor_key) kv[c] = 0;
          }
          fn(kv, ix);
        });
      }
    };
    const int2 digits[4] = {{11, 8}, {3, 8}, {0, 3}, {0, 0}};
    refine(cand_sweep, digits, 3);
    // Collect the bin's keys above the threshold T, and the first `need` keys equal to it by
    // index (all keys >= T when the last bin was taken whole), after sel[0, above).
    const unsigned T = st.prefix;
    const bool ordered = !st.done;
    const unsigned need_eq = ordered ? st.need : 0u;
    unsigned n_gt = 0, running = 0;
    cand_sweep([&](const uint32_t (&kv)[4], const uint32_t (&ix)[4]) {
      unsigned gtm = 0, eqm = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool vis = kv[c] != 0;
        gtm |= unsigned(vis && (ordered ? kv[c] > T : kv[c] >= T)) << c;
        eqm |= unsigned(ordered && vis && kv[c] == T) << c;
      }
      const uint2 sc = block_scan(__popc(gtm) | (__popc(eqm) << 16));
      unsigned slot = above + n_gt + (sc.x & 0xffffu), rank = running + (sc.x >> 16);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const unsigned long long e = (static_cast<unsigned long long>(kv[c]) << 32) | (0xffffffffu - ix[c]);
        if (gtm & (1u << c)) sel[slot++] = e;
        if (eqm & (1u << c)) {
          if (rank < need_eq) sel[kprime - need_eq + rank] = e;
          ++rank;
        }
      }
      n_gt += sc.y & 0xffffu;
      running += sc.y >> 16;
    });
  }
  SortWriteSelected<NT>(sel, kprime, topk, r, out, out_scores);
}

// ---------------------------------------------------------------------------------------------
// Host side

std::atomic<uint64_t> g_prepared{0};  // bit per device ordinal (< 64)

int NumSms(int dev) {
  static std::atomic<int> cached[64] = {};
  if (dev < 0 || dev >= 64) return 132;
  int v = cached[dev].load();
  if (v <= 0) {
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || v <= 0) {
      cudaGetLastError();
      v = 132;
    }
    cached[dev].store(v);
  }
  return v;
}

}  // namespace

cudaError_t TopkPrepare() {
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit && (g_prepared.load() & bit)) return cudaSuccess;
  struct Limit {
    const void* fn;
    int smem;
  };
  const Limit limits[] = {
      {reinterpret_cast<const void*>(&ScoreKernelWg<1>), kWgSmem},
      {reinterpret_cast<const void*>(&ScoreKernelWg<2>), kWgSmem},
      {reinterpret_cast<const void*>(&ScoreKernelWg<1, true>), kWgSmem},
      {reinterpret_cast<const void*>(&ScoreKernelWg<2, true>), kWgSmem},
      {reinterpret_cast<const void*>(&TopkCachedKernel), kCacheMaxElems * 4},
      {reinterpret_cast<const void*>(&TopkTwoSweepKernel), kTwoSweepSmem},
  };
  for (const Limit& l : limits) {
    cudaError_t e = cudaFuncSetAttribute(l.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, l.smem);
    if (e != cudaSuccess) return e;
  }
  if (bit) g_prepared.fetch_or(bit);
  return cudaSuccess;
}

cudaError_t LaunchTopk(const TopkLaunch& a, const char** what) {
  *what = "preparing the kernels";
  if (cudaError_t e = TopkPrepare(); e != cudaSuccess) return e;
  if (a.nb == 0 || a.s_q == 0) return cudaSuccess;
  int dev = 0;
  cudaGetDevice(&dev);
  const int sms = NumSms(dev);
  const bool score_only = a.stages == 1;
  const bool topk_only = a.stages == 2;
  const int G = int(a.heads / 32);
  const int BQ = 8 / G;
  const int64_t ld = int64_t(TopkRowStride(a.s_kv));
  const int nt = int(ld / kBN);
  unsigned char* ws = static_cast<unsigned char*>(a.workspace);
  float* scores = reinterpret_cast<float*>(ws);
  int2* ranges = reinterpret_cast<int2*>(ws + TopkAlign(size_t(a.chunk_rows) * ld * 4));
  int4* stats = reinterpret_cast<int4*>(ws + TopkAlign(size_t(a.chunk_rows) * ld * 4) +
                                        TopkAlign(size_t(a.chunk_rows) * 8));
  const auto score_fn = G == 1 ? &ScoreKernelWg<1> : &ScoreKernelWg<2>;
  const auto* qb = static_cast<const __nv_bfloat16*>(a.q);
  const auto* kb = static_cast<const __nv_bfloat16*>(a.k);
  for (int64_t b = 0; b < a.nb; ++b) {
    const int32_t* kv_pos = a.kv_pos + b * a.s_kv;
    const int32_t* kv_seg = a.kv_seg + b * a.s_kv;
    const __nv_bfloat16* kk = kb + b * a.s_kv * kD;
    *what = "launching the key-tile statistics kernel";
    TileStatsKernel<<<(nt + 255) / 256, 256, 0, a.stream>>>(kv_pos, kv_seg, int(a.s_kv), nt, stats);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    for (int64_t c0 = 0; c0 < a.s_q; c0 += a.chunk_rows) {
      const int rows = int(std::min<int64_t>(a.chunk_rows, a.s_q - c0));
      const int64_t t0 = b * a.s_q + c0;
      const int gx = (rows + BQ - 1) / BQ;
      int gy = 1;
      if (gx < 2 * sms) gy = std::max(1, std::min((2 * sms + gx - 1) / gx, std::max(1, nt / 8)));
      const dim3 grid(gx, gy);
      const __nv_bfloat16* qq = qb + t0 * a.heads * kD;
      const float* ww = a.w + t0 * a.heads;
      *what = "launching the score kernel";
      if (!topk_only) {
        score_fn<<<grid, kWgThreads, kWgSmem, a.stream>>>(qq, kk, ww, a.q_pos + t0, a.q_seg + t0, kv_pos,
                                                         kv_seg, stats, nt, rows, int(a.s_kv), ld, scores,
                                                         ranges);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      }
      if (score_only) continue;
      *what = "launching the top-k kernel";
      int32_t* oo = a.out + t0 * a.topk;
      float* os = a.out_scores ? a.out_scores + t0 * a.topk : nullptr;
      if (ld <= kCacheMaxElems)
        TopkCachedKernel<<<rows, kTopkThreads, size_t(ld) * 4, a.stream>>>(scores, ld, ranges, int(a.topk),
                                                                           oo, os);
      else
        TopkTwoSweepKernel<<<rows, kTopkThreads, kTwoSweepSmem, a.stream>>>(scores, ld, ranges, int(a.topk),
                                                                            oo, os);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    }
  }
  *what = "";
  return cudaSuccess;
}

cudaError_t LaunchIndexLse(const TopkLaunch& a, float* lse, const char** what) {
  *what = "preparing the kernels";
  if (cudaError_t e = TopkPrepare(); e != cudaSuccess) return e;
  if (a.nb == 0 || a.s_q == 0) return cudaSuccess;
  int dev = 0;
  cudaGetDevice(&dev);
  const int sms = NumSms(dev);
  const int G = int(a.heads / 32);
  const int BQ = 8 / G;
  const int64_t ld = int64_t(TopkRowStride(a.s_kv));
  const int nt = int(ld / kBN);
  const int rows = int(a.s_q);
  unsigned char* ws = static_cast<unsigned char*>(a.workspace);
  const int64_t n_part = IndexLsePartials(a.s_q);
  float2* partials = reinterpret_cast<float2*>(ws);
  int2* ranges = reinterpret_cast<int2*>(ws + TopkAlign(size_t(n_part) * 8));
  int4* stats = reinterpret_cast<int4*>(ws + TopkAlign(size_t(n_part) * 8) + TopkAlign(size_t(rows) * 8));
  const int gx = (rows + BQ - 1) / BQ;
  int gy = 1;  // as LaunchTopk, within the partials' room
  if (gx < 2 * sms) gy = std::max(1, std::min((2 * sms + gx - 1) / gx, std::max(1, nt / 8)));
  gy = int(std::max<int64_t>(1, std::min<int64_t>(gy, n_part / rows)));
  const auto fn = G == 1 ? &ScoreKernelWg<1, true> : &ScoreKernelWg<2, true>;
  for (int64_t b = 0; b < a.nb; ++b) {
    const int32_t* kv_pos = a.kv_pos + b * a.s_kv;
    const int32_t* kv_seg = a.kv_seg + b * a.s_kv;
    const int64_t t0 = b * a.s_q;
    *what = "launching the key-tile statistics kernel";
    TileStatsKernel<<<(nt + 255) / 256, 256, 0, a.stream>>>(kv_pos, kv_seg, int(a.s_kv), nt, stats);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    *what = "launching the score kernel";
    fn<<<dim3(gx, gy), kWgThreads, kWgSmem, a.stream>>>(
        static_cast<const __nv_bfloat16*>(a.q) + t0 * a.heads * kD,
        static_cast<const __nv_bfloat16*>(a.k) + b * a.s_kv * kD, a.w + t0 * a.heads, a.q_pos + t0,
        a.q_seg + t0, kv_pos, kv_seg, stats, nt, rows, int(a.s_kv), ld,
        reinterpret_cast<float*>(partials), ranges);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    *what = "launching the combine kernel";
    LseCombineKernel<<<(rows + 255) / 256, 256, 0, a.stream>>>(partials, gy, rows, lse + t0);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  *what = "";
  return cudaSuccess;
}

}  // namespace indexer
}  // namespace jax_dsa
