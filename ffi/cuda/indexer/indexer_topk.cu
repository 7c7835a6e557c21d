// The lightning indexer's top-k kernels (SM90, plain CUDA C++): see indexer_topk.h.

#include "indexer_topk.h"

#include <cuda_bf16.h>

#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstdlib>

namespace jax_dsa {
namespace indexer {
namespace {

constexpr int kD = kTopkHeadDim;
constexpr int kBN = kTopkKeyTile;         // keys per tile
constexpr int kScoreThreads = 256;        // 8 warps: 8 queries x 32 heads, or 4 x 64
constexpr int kTileBytes = kBN * kD * 2;  // 16 KiB of bf16 keys
constexpr int kRowBytes = kD * 2;         // 256 bytes a key
constexpr int kTopkThreads = 1024;
constexpr int kCacheMaxElems = 40960;     // rows up to this many keys are kept in shared memory
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

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// d += a (16x16 bf16, row) * b (16x8 bf16, col), fp32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// ---------------------------------------------------------------------------------------------
// (2) Scores of one chunk of query rows.
//
// CTA: 8 warps; warp w takes query row0 + w / G and heads [32 (w % G), +32) (G = heads / 32).
// Its q (32 heads x 128, bf16) stays in registers as mma A fragments for the CTA's lifetime. Key
// tiles [64, 128] bf16 stream through a 3-stage cp.async ring in shared memory (16-byte chunks
// XOR-swizzled by row so that ldmatrix is conflict-free). Per tile each warp computes
// [32 heads x 64 keys] in NTS*8-key steps, then relu, times w, and sums its 32 heads: four rows
// in registers, then a reduce-scatter over the 8 lane groups (xor 16, 8, 4), so that every key's
// sum is formed by the same tree (bitwise equal scores for equal keys). With G = 2 the two head
// halves are added through shared memory (in the same order for every key).
template <int G, int NTS, int MINB, bool HOIST, int STAGES>
__global__ void __launch_bounds__(kScoreThreads, MINB)
ScoreKernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
            const float* __restrict__ w, const int32_t* __restrict__ q_pos,
            const int32_t* __restrict__ q_seg, const int32_t* __restrict__ kv_pos,
            const int32_t* __restrict__ kv_seg, const int4* __restrict__ stats, int nt, int rows,
            int s_kv, int64_t ld, float* __restrict__ scores, int2* __restrict__ ranges) {
  constexpr int BQ = 8 / G;
  constexpr int H = 32 * G;
  constexpr int NSUB = kBN / (8 * NTS);
  constexpr int W0 = 2 * NTS;      // values a lane holds per step before the head reduction
  constexpr int WF = W0 / 8;       // ... and after it
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float red[NSUB][G > 1 ? BQ : 1][G > 1 ? 8 * NTS : 1];
  __shared__ int s_lo, s_hi, s_qmax, s_smin, s_smax;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // the longest rows (causal) first
  const int qi = warp / G, g = warp % G;
  const int row = row0 + qi;
  const bool row_ok = row < rows;

  if (tid == 0) {
    int qmax = INT_MIN, smin = INT_MAX, smax = INT_MIN;
    for (int i = 0; i < BQ; ++i) {
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
    for (int j = tid; j < nt; j += kScoreThreads) {
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
  if (blockIdx.y == 0 && tid < BQ && row0 + tid < rows)
    ranges[row0 + tid] = make_int2(t_lo * kBN, t_hi * kBN);
  const int per = (t_hi - t_lo + int(gridDim.y) - 1) / int(gridDim.y);
  const int j0 = t_lo + int(blockIdx.y) * per, j1 = min(t_hi, j0 + per);
  if (j0 >= j1) return;  // uniform over the CTA

  // This warp's q as A fragments (rows = heads, cols = d), its 4 head weights, its position
  // (rows past the chunk read row 0 and are never stored).
  const int rr = row_ok ? row : 0;
  uint32_t a[2][8][4];
  float wr[2][2];
  const int hb = g * 32 + (lane >> 2);
  {
    const __nv_bfloat16* qr = q + (int64_t(rr) * H + hb) * kD + 2 * (lane & 3);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const __nv_bfloat16* p = qr + mt * 16 * kD + ks * 16;
        a[mt][ks][0] = *reinterpret_cast<const uint32_t*>(p);
        a[mt][ks][1] = *reinterpret_cast<const uint32_t*>(p + 8 * kD);
        a[mt][ks][2] = *reinterpret_cast<const uint32_t*>(p + 8);
        a[mt][ks][3] = *reinterpret_cast<const uint32_t*>(p + 8 * kD + 8);
      }
      wr[mt][0] = w[int64_t(rr) * H + hb + mt * 16];
      wr[mt][1] = w[int64_t(rr) * H + hb + mt * 16 + 8];
    }
  }
  const int qp = q_pos[rr];
  const int qs = q_seg[rr];
  float* out_row = scores + int64_t(rr) * ld;

  const uint32_t sbase = SmemAddr(smem);
  auto load_tile = [&](int j, int stage) {
    const uint32_t dst = sbase + stage * kTileBytes;
#pragma unroll
    for (int i = 0; i < (kBN * kD / 8) / kScoreThreads; ++i) {
      const int x = tid + kScoreThreads * i;
      const int r = x >> 4, c = x & 15;
      const int s = j * kBN + r;
      const bool v = s < s_kv;
      CpAsync16(dst + r * kRowBytes + ((c ^ (r & 7)) << 4), k + int64_t(v ? s : 0) * kD + c * 8, v);
    }
  };

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (j0 + i < j1) load_tile(j0 + i, i);
    CpAsyncCommit();
  }
  // Lane's values after the head reduction: v-index x = x0 + i, key column
  // (x >> 1) * 8 + 2 (lane & 3) + (x & 1) of the step.
  const int x0 = ((lane & 16) ? W0 / 2 : 0) + ((lane & 8) ? W0 / 4 : 0) + ((lane & 4) ? WF : 0);
  // ldmatrix x4 lane roles: matrix lane>>3 (keys +0/+8, d +0/+8), row lane&7.
  const int lm_row = (lane & 7) + ((lane >> 4) << 3);
  const int lm_chunk = (lane >> 3) & 1;
  const int lm_xor = lane & 7;

  for (int j = j0; j < j1; ++j) {
    const int it = j - j0;
    CpAsyncWait<STAGES - 2>();
    __syncthreads();
    {
      const int jn = j + STAGES - 1;
      if (jn < j1) load_tile(jn, (it + STAGES - 1) % STAGES);
      CpAsyncCommit();
    }
    const uint32_t tb = sbase + (it % STAGES) * kTileBytes;
    // This lane's key columns of the tile: positions and segments, loaded before the products
    // (HOIST) so that their latency hides behind them.
    int kvp[NSUB][WF], kvs[NSUB][WF];
    if constexpr (HOIST) {
#pragma unroll
      for (int sub = 0; sub < NSUB; ++sub) {
#pragma unroll
        for (int i = 0; i < WF; ++i) {
          const int x = x0 + i;
          const int s = min(j * kBN + sub * NTS * 8 + (x >> 1) * 8 + 2 * (lane & 3) + (x & 1), s_kv - 1);
          kvp[sub][i] = __ldg(kv_pos + s);
          kvs[sub][i] = __ldg(kv_seg + s);
        }
      }
    }
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      float acc[2][NTS][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < NTS; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][n][i] = 0.f;
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
        for (int np = 0; np < NTS / 2; ++np) {
          const int krow = sub * NTS * 8 + np * 16 + lm_row;
          const uint32_t addr = tb + krow * kRowBytes + (((2 * ks + lm_chunk) ^ lm_xor) << 4);
          uint32_t b0, b1, b2, b3;
          LdMatrixX4(addr, b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            Mma(acc[mt][2 * np], a[mt][ks], b0, b1);
            Mma(acc[mt][2 * np + 1], a[mt][ks], b2, b3);
          }
        }
      }
      // relu, weight, and this lane's 4 heads (the same order for every key).
      float v[W0];
#pragma unroll
      for (int n = 0; n < NTS; ++n) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float p = fmaxf(acc[0][n][c], 0.f) * wr[0][0];
          p = fmaf(fmaxf(acc[0][n][2 + c], 0.f), wr[0][1], p);
          p = fmaf(fmaxf(acc[1][n][c], 0.f), wr[1][0], p);
          p = fmaf(fmaxf(acc[1][n][2 + c], 0.f), wr[1][1], p);
          v[2 * n + c] = p;
        }
      }
      // Reduce-scatter over the lane groups (lane bits 4, 3, 2).
      float v1[W0 / 2];
      {
        const bool hi = lane & 16;
#pragma unroll
        for (int i = 0; i < W0 / 2; ++i) {
          const float send = hi ? v[i] : v[W0 / 2 + i];
          const float keep = hi ? v[W0 / 2 + i] : v[i];
          v1[i] = keep + __shfl_xor_sync(kFull, send, 16);
        }
      }
      float v2[W0 / 4];
      {
        const bool hi = lane & 8;
#pragma unroll
        for (int i = 0; i < W0 / 4; ++i) {
          const float send = hi ? v1[i] : v1[W0 / 4 + i];
          const float keep = hi ? v1[W0 / 4 + i] : v1[i];
          v2[i] = keep + __shfl_xor_sync(kFull, send, 8);
        }
      }
      float fv[WF];
      {
        const bool hi = lane & 4;
#pragma unroll
        for (int i = 0; i < WF; ++i) {
          const float send = hi ? v2[i] : v2[WF + i];
          const float keep = hi ? v2[WF + i] : v2[i];
          fv[i] = keep + __shfl_xor_sync(kFull, send, 4);
        }
      }
      if constexpr (G > 1) {
        if (g != 0) {
#pragma unroll
          for (int i = 0; i < WF; ++i) {
            const int x = x0 + i;
            red[sub][qi][(x >> 1) * 8 + 2 * (lane & 3) + (x & 1)] = fv[i];
          }
        }
        __syncthreads();
        if (g == 0) {
#pragma unroll
          for (int i = 0; i < WF; ++i) {
            const int x = x0 + i;
            fv[i] = fv[i] + red[sub][qi][(x >> 1) * 8 + 2 * (lane & 3) + (x & 1)];
          }
        }
      }
      if (g == 0 && row_ok) {
        float sc[WF];
        int s_first = 0;
#pragma unroll
        for (int i = 0; i < WF; ++i) {
          const int x = x0 + i;
          const int s = j * kBN + sub * NTS * 8 + (x >> 1) * 8 + 2 * (lane & 3) + (x & 1);
          if (i == 0) s_first = s;
          bool vis = false;
          if constexpr (HOIST) {
            vis = s < s_kv && kvp[sub][i] <= qp && kvs[sub][i] == qs;
          } else {
            if (s < s_kv) vis = __ldg(kv_pos + s) <= qp && __ldg(kv_seg + s) == qs;
          }
          // Visible: clamp to the lowest finite float (never -inf), -0.0 -> +0.0.
          sc[i] = vis ? fmaxf(fv[i], -FLT_MAX) + 0.f : -INFINITY;
        }
        if constexpr (WF == 2) {
          *reinterpret_cast<float2*>(out_row + s_first) = make_float2(sc[0], sc[1]);
        } else {
#pragma unroll
          for (int i = 0; i < WF; ++i) {
            const int x = x0 + i;
            out_row[j * kBN + sub * NTS * 8 + (x >> 1) * 8 + 2 * (lane & 3) + (x & 1)] = sc[i];
          }
        }
      }
    }
  }
  CpAsyncWait<0>();
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

// FAST (the default): each sweep issues four loads a thread before their first use, and the
// sort runs its strides < 64 in registers and warp shuffles (two entries a thread) instead of
// shared memory: 15 of its 66 steps touch shared memory instead of all of them.
template <bool CACHE, bool FAST>
__global__ void __launch_bounds__(kTopkThreads, 1)
TopkKernel(const float* __restrict__ scores, int64_t ld, const int2* __restrict__ ranges, int topk,
           int32_t* __restrict__ out, float* __restrict__ out_scores) {
  extern __shared__ uint4 cache4[];  // CACHE: the row's keys
  __shared__ unsigned hist[256];
  __shared__ unsigned long long sel[kTopkMaxK];
  __shared__ unsigned wtot[2][32];
  __shared__ SelectState st;
  __shared__ unsigned s_cnt;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = blockIdx.x;
  const int2 rg = ranges[r];
  const int lo = rg.x, n = rg.y - rg.x;  // n: a multiple of 64
  const float4* src4 = reinterpret_cast<const float4*>(scores + int64_t(r) * ld + lo);

  auto key4 = [&](int i4, bool first) -> uint4 {
    if (CACHE && !first) return cache4[i4];
    const float4 f = __ldcs(src4 + i4);
    const uint4 kk = make_uint4(ScoreKey(f.x), ScoreKey(f.y), ScoreKey(f.z), ScoreKey(f.w));
    if (CACHE) cache4[i4] = kk;
    return kk;
  };
  // fn(i, keys of elements i..i+3) for every thread's 4 elements of the row, in index order
  // tile by tile (every thread makes the same calls: elements past the row are 0 = invisible).
  auto sweep = [&](bool first, auto&& fn) {
    constexpr int U = FAST ? 4 : 1;
    for (int base = 0; base < n; base += U * 4 * kTopkThreads) {
      uint4 kk[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * 4 * kTopkThreads + 4 * tid;
        kk[u] = i < n ? key4(i >> 2, first) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) fn(base + u * 4 * kTopkThreads + 4 * tid, kk[u]);
    }
  };

  // Radix select, 8 bits a pass from the top, over the keys of the prefix chosen so far. The
  // first pass reads the row (and caches its keys), counts the visible keys and takes every one
  // of them when there are at most topk. A pass stops the search when the chosen bucket is
  // taken whole (select every key >= prefix); after the fourth the prefix is the exact
  // threshold T and `need` keys equal to T are still to take, the lowest indices first.
  if (tid == 0) s_cnt = 0;
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
      unsigned c[8];
      unsigned local = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        c[i] = hist[255 - 8 * lane - i];
        local += c[i];
      }
      const unsigned incl = WarpInclusiveSum(local, lane);
      const unsigned excl = incl - local;
      const unsigned total = __shfl_sync(kFull, incl, 31);
      const bool take_all = p == 0 && total <= unsigned(topk);
      if (take_all && lane == 0) {
        st.kprime = total;
        st.prefix = 0;
        st.need = 0;
        st.done = 1;
      }
      if (!take_all && excl < need && need <= incl) {  // exactly one lane
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
        if (p == 0) st.kprime = unsigned(topk);
        st.prefix = prefix | (bin << shift);
        st.need = need - above;
        st.done = eq == need - above;
      }
    }
    __syncthreads();
  }

  // Collect: keys > T all; keys == T the first `need` by index (ordered), unless done (>= T).
  const unsigned T = st.prefix;
  const bool ordered = !st.done;
  const unsigned need_eq = ordered ? st.need : 0u;
  const unsigned kprime = st.kprime;
  const unsigned gt_base = 0;  // slots [0, kprime - need_eq) for keys > T (any order)
  unsigned running = 0;        // keys == T seen in earlier tiles (ordered)
  int par = 0;
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
      // Keys above the threshold: warp-aggregated slots.
      const unsigned ngt = __popc(gtm);
      if (__any_sync(kFull, ngt != 0)) {
        const unsigned incl = WarpInclusiveSum(ngt, lane);
        unsigned wbase = 0;
        if (lane == 31) wbase = atomicAdd(&s_cnt, incl);
        wbase = __shfl_sync(kFull, wbase, 31);
        unsigned slot = gt_base + wbase + incl - ngt;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (gtm & (1u << c)) {
            const uint32_t idx = uint32_t(lo + i + c);
            sel[slot++] = (static_cast<unsigned long long>(kv[c]) << 32) | (0xffffffffu - idx);
          }
        }
      }
      if (ordered) {  // uniform
        const unsigned neq = __popc(eqm);
        const unsigned incl = WarpInclusiveSum(neq, lane);
        if (lane == 31) wtot[par][warp] = incl;
        __syncthreads();
        unsigned before = 0, tile_total = 0;
        for (int q = 0; q < 32; ++q) {
          const unsigned t = wtot[par][q];
          before += q < warp ? t : 0u;
          tile_total += t;
        }
        unsigned rank = running + before + incl - neq;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (eqm & (1u << c)) {
            if (rank < need_eq) {
              const uint32_t idx = uint32_t(lo + i + c);
              sel[kprime - need_eq + rank] =
                  (static_cast<unsigned long long>(kv[c]) << 32) | (0xffffffffu - idx);
            }
            ++rank;
          }
        }
        running += tile_total;
        par ^= 1;
      }
    });
  }
  if constexpr (FAST) {
    // Bitonic sort, descending, of P = max(64, 2^ceil(log2 kprime)) entries (0-padded): thread
    // t < P / 2 holds entries 2t, 2t+1; strides >= 64 go through shared memory, the others
    // through warp shuffles (stride s: partner thread t ^ s / 2) and, for s = 1, in-thread.
    unsigned P = 64;
    while (P < kprime) P <<= 1;
    const bool act = unsigned(tid) < P / 2;
    const unsigned e0 = 2u * unsigned(tid);
    __syncthreads();
    unsigned long long x0 = 0, x1 = 0;
    if (act) {
      x0 = e0 < kprime ? sel[e0] : 0ull;
      x1 = e0 + 1 < kprime ? sel[e0 + 1] : 0ull;
    }
    if (kprime > 1) {
      for (unsigned size = 2; size <= P; size <<= 1) {
        unsigned s = size >> 1;
        if (s >= 64) {
          __syncthreads();
          if (act) {
            sel[e0] = x0;
            sel[e0 + 1] = x1;
          }
          __syncthreads();
          for (; s >= 64; s >>= 1) {
            if (act) {
              const unsigned i = e0 - (unsigned(tid) & (s - 1));
              const unsigned jj = i + s;
              const bool desc = (i & size) == 0;
              const unsigned long long x = sel[i], y = sel[jj];
              if ((x < y) == desc) {
                sel[i] = y;
                sel[jj] = x;
              }
            }
            __syncthreads();
          }
          if (act) {
            x0 = sel[e0];
            x1 = sel[e0 + 1];
          }
        }
        if (act) {
          const bool desc = (e0 & size) == 0;
          for (; s >= 2; s >>= 1) {
            const unsigned long long y0 = __shfl_xor_sync(kFull, x0, int(s >> 1));
            const unsigned long long y1 = __shfl_xor_sync(kFull, x1, int(s >> 1));
            const bool keep_max = ((e0 & s) == 0) == desc;
            x0 = keep_max ? (x0 > y0 ? x0 : y0) : (x0 < y0 ? x0 : y0);
            x1 = keep_max ? (x1 > y1 ? x1 : y1) : (x1 < y1 ? x1 : y1);
          }
          if ((x0 < x1) == desc) {
            const unsigned long long t = x0;
            x0 = x1;
            x1 = t;
          }
        }
      }
    }
    int32_t* o = out + int64_t(r) * topk;
    float* os = out_scores ? out_scores + int64_t(r) * topk : nullptr;
    if (act) {
      if (e0 < unsigned(topk)) {
        o[e0] = e0 < kprime ? int32_t(0xffffffffu - uint32_t(x0 & 0xffffffffull)) : -1;
        if (os) os[e0] = e0 < kprime ? KeyScore(uint32_t(x0 >> 32)) : -INFINITY;
      }
      if (e0 + 1 < unsigned(topk)) {
        o[e0 + 1] = e0 + 1 < kprime ? int32_t(0xffffffffu - uint32_t(x1 & 0xffffffffull)) : -1;
        if (os) os[e0 + 1] = e0 + 1 < kprime ? KeyScore(uint32_t(x1 >> 32)) : -INFINITY;
      }
    }
    for (int i = int(P) + tid; i < topk; i += kTopkThreads) {
      o[i] = -1;
      if (os) os[i] = -INFINITY;
    }
  } else {
    // Pad to a power of two with 0 (below every real entry) and sort descending.
    unsigned P = 1;
    while (P < kprime) P <<= 1;
    __syncthreads();
    for (unsigned i = kprime + tid; i < P; i += kTopkThreads) sel[i] = 0ull;
    __syncthreads();
    if (kprime > 1) {
      for (unsigned size = 2; size <= P; size <<= 1) {
        for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
          for (unsigned t = tid; t < P / 2; t += kTopkThreads) {
            const unsigned i = 2 * t - (t & (stride - 1));
            const unsigned jj = i + stride;
            const bool desc = (i & size) == 0;
            const unsigned long long x = sel[i], y = sel[jj];
            if ((x < y) == desc) {
              sel[i] = y;
              sel[jj] = x;
            }
          }
          __syncthreads();
        }
      }
    }
    int32_t* o = out + int64_t(r) * topk;
    for (int i = tid; i < topk; i += kTopkThreads) {
      o[i] = unsigned(i) < kprime ? int32_t(0xffffffffu - uint32_t(sel[i] & 0xffffffffull)) : -1;
      if (out_scores)
        out_scores[int64_t(r) * topk + i] =
            unsigned(i) < kprime ? KeyScore(uint32_t(sel[i] >> 32)) : -INFINITY;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

// Score kernel variants: <heads / 32, key columns a step / 8, CTAs an SM, positions loaded
// before the products, pipeline stages>. 64 keys a step need 198 registers (one CTA an SM), 32
// keys a step fit 128 (two CTAs). TopkLaunch::score_variant (-1: JAX_DSA_INDEXER_SCORE_VARIANT,
// benchmarks only, else the default) picks one. All give the same bits (the same products and the
// same head-sum tree). H200, GLM-5 32K causal, score kernels alone: v0 18.0 ms, v1 13.2, v2 15.4,
// v3 12.0, v4 12.0 (benchmarks/results/gpu_indexer_topk_h200.json).
using ScoreFnT = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const float*, const int32_t*,
                          const int32_t*, const int32_t*, const int32_t*, const int4*, int, int, int,
                          int64_t, float*, int2*);
struct ScoreVariantFns {
  ScoreFnT fn[2];  // G = 1, 2
  int stages;
};
constexpr int kNumScoreVariants = 5;
const ScoreVariantFns kScoreFns[kNumScoreVariants] = {
    {{&ScoreKernel<1, 8, 1, false, 3>, &ScoreKernel<2, 8, 1, false, 3>}, 3},
    {{&ScoreKernel<1, 4, 2, false, 3>, &ScoreKernel<2, 4, 2, false, 3>}, 3},
    {{&ScoreKernel<1, 8, 1, true, 3>, &ScoreKernel<2, 8, 1, true, 3>}, 3},
    {{&ScoreKernel<1, 4, 2, true, 3>, &ScoreKernel<2, 4, 2, true, 3>}, 3},
    {{&ScoreKernel<1, 4, 2, true, 4>, &ScoreKernel<2, 4, 2, true, 4>}, 4},
};
constexpr int kDefaultScoreVariant = 3;

// The variant switches below are read once per process (benchmarks set them before the first call).
int ScoreVariant() {
  static const int chosen = [] {
    const char* v = std::getenv("JAX_DSA_INDEXER_SCORE_VARIANT");
    if (v && v[0] >= '0' && v[0] < '0' + kNumScoreVariants && v[1] == 0) return v[0] - '0';
    return kDefaultScoreVariant;
  }();
  return chosen;
}

// Top-k kernel variants: 0: every sweep one load a thread at a time, the sort all in shared
// memory; 1 (FAST): four loads in flight, the sort's short strides in registers (H200, GLM-5 16K
// causal, top-k kernel alone: 3.83 ms -> 2.84 ms). Same results.
constexpr int kNumTopkVariants = 2;
constexpr int kDefaultTopkVariant = 1;

int TopkVariant() {
  static const int chosen = [] {
    const char* v = std::getenv("JAX_DSA_INDEXER_TOPK_VARIANT");
    if (v && v[0] >= '0' && v[0] < '0' + kNumTopkVariants && v[1] == 0) return v[0] - '0';
    return kDefaultTopkVariant;
  }();
  return chosen;
}

// JAX_DSA_INDEXER_STAGES=score runs the score kernels alone (the indices are left unwritten):
// benchmarks only, to time the two stages apart.
// Read at each launch (one getenv, no allocation): benchmarks/gpu_indexer_topk.py switches it
// between calls of one process.
bool ScoreOnly() {
  const char* v = std::getenv("JAX_DSA_INDEXER_STAGES");
  return v && v[0] == 's';
}

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
  cudaError_t e;
  for (int v = 0; v < kNumScoreVariants; ++v) {
    for (int g = 0; g < 2; ++g) {
      e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kScoreFns[v].fn[g]),
                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kScoreFns[v].stages * kTileBytes);
      if (e != cudaSuccess) return e;
    }
  }
  for (const void* f : {reinterpret_cast<const void*>(&TopkKernel<true, false>),
                        reinterpret_cast<const void*>(&TopkKernel<true, true>)}) {
    e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, kCacheMaxElems * 4);
    if (e != cudaSuccess) return e;
  }
  if (bit) g_prepared.fetch_or(bit);
  return cudaSuccess;
}

int TopkScoreVariants() { return kNumScoreVariants; }
int TopkTopkVariants() { return kNumTopkVariants; }

cudaError_t LaunchTopk(const TopkLaunch& a, const char** what) {
  *what = "preparing the kernels";
  if (cudaError_t e = TopkPrepare(); e != cudaSuccess) return e;
  if (a.nb == 0 || a.s_q == 0) return cudaSuccess;
  int dev = 0;
  cudaGetDevice(&dev);
  const int sms = NumSms(dev);
  const int variant = a.score_variant >= 0 && a.score_variant < kNumScoreVariants ? a.score_variant
                                                                                 : ScoreVariant();
  const bool score_only = a.stages == 1 || (a.stages == 0 && ScoreOnly());
  const bool topk_only = a.stages == 2;
  const int topk_variant = a.topk_variant >= 0 && a.topk_variant < kNumTopkVariants ? a.topk_variant
                                                                                  : TopkVariant();
  const int G = int(a.heads / 32);
  const int BQ = 8 / G;
  const int64_t ld = int64_t(TopkRowStride(a.s_kv));
  const int nt = int(ld / kBN);
  unsigned char* ws = static_cast<unsigned char*>(a.workspace);
  float* scores = reinterpret_cast<float*>(ws);
  int2* ranges = reinterpret_cast<int2*>(ws + TopkAlign(size_t(a.chunk_rows) * ld * 4));
  int4* stats = reinterpret_cast<int4*>(ws + TopkAlign(size_t(a.chunk_rows) * ld * 4) +
                                        TopkAlign(size_t(a.chunk_rows) * 8));
  const bool cache = ld <= kCacheMaxElems;
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
        kScoreFns[variant].fn[G - 1]<<<grid, kScoreThreads, kScoreFns[variant].stages * kTileBytes,
                                       a.stream>>>(qq, kk, ww, a.q_pos + t0, a.q_seg + t0, kv_pos,
                                                   kv_seg, stats, nt, rows, int(a.s_kv), ld, scores,
                                                   ranges);
        if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
      }
      if (score_only) continue;
      *what = "launching the top-k kernel";
      int32_t* oo = a.out + t0 * a.topk;
      float* os = a.out_scores ? a.out_scores + t0 * a.topk : nullptr;
      const size_t smem = cache ? size_t(ld) * 4 : 0;
      if (topk_variant == 0) {
        if (cache)
          TopkKernel<true, false><<<rows, kTopkThreads, smem, a.stream>>>(scores, ld, ranges, int(a.topk), oo, os);
        else
          TopkKernel<false, false><<<rows, kTopkThreads, 0, a.stream>>>(scores, ld, ranges, int(a.topk), oo, os);
      } else {
        if (cache)
          TopkKernel<true, true><<<rows, kTopkThreads, smem, a.stream>>>(scores, ld, ranges, int(a.topk), oo, os);
        else
          TopkKernel<false, true><<<rows, kTopkThreads, 0, a.stream>>>(scores, ld, ranges, int(a.topk), oo, os);
      }
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    }
  }
  *what = "";
  return cudaSuccess;
}

}  // namespace indexer
}  // namespace jax_dsa
