// SM90 grouped matmuls for the routed experts (issue 46): forward, input gradient and weight
// gradient, bf16 in, fp32 accumulation, bf16 out. Contract and API: grouped_matmul.h; design and
// measurements: benchmarks/notes/grouped_matmul.md.
//
// One persistent, warp-specialised kernel serves all three products (MODE):
//   CTA = 3 warpgroups (384 threads). Warpgroup 0 is the producer: one thread streams the A and B
//   tiles of each k-step into a kStages-deep ring of shared memory with TMA (cp.async.bulk.tensor,
//   128-byte swizzle) completing on the stage's `full` mbarrier. Warpgroups 1 and 2 are consumers:
//   each owns 64 rows of the 128 x 256 output tile and runs wgmma m64n256k16 (fp32 accumulators
//   in registers) on the stage, then releases it through the stage's `empty` mbarrier.
//   Tile order is static: CTA b takes work items b, b + gridDim.x, ...; producer and consumers walk
//   the same sequence, so they agree without talking.
// Operand majors (wgmma reads either from the same swizzled bytes; TRANS 1 = MN-major):
//   kFwd   A = lhs tile [128 rows, 64 k] K-major        B = rhs[g] tile [64 k, 256 n] MN-major
//   kDgrad A = d_out tile [128 rows, 64 n] K-major      B = rhs[g] rows [256 k, 64 n] K-major
//   kWgrad A = lhs^T tile [128 k, 64 rows] MN-major     B = d_out tile [64 rows, 256 n] MN-major
// Scheduling: kFwd / kDgrad (m-grouped): work item = (m-tile, n-tile) over the concatenation of
// every group's ceil(rows_g / 128) m-tiles (a prep kernel writes the clamped row offsets and the
// tile prefix sums to the workspace; each CTA copies them to shared memory and finds an m-tile's
// group by binary search). Rows of a tile past its group's end are computed on the next group's
// rows (or TMA's zero fill past M) and never stored. kWgrad (k-grouped): work item = (group,
// m-tile over K, n-tile over N); the contraction runs over the group's rows in chunks of 64; in
// the last, partial chunk the consumers zero the rows past the group's end in both operands
// before the MMA, so no other group's rows (not even a NaN there) reach this group's sum.
// Epilogue (variant 1, the default): each consumer writes its 64 x 256 half as bf16 into a swizzled
// staging buffer and one thread issues 4 TMA stores that drain under the next tile's MMAs; a half
// with rows to mask (a group's last m-tile) is stored directly from registers (variant 0 stores
// everything that way, with a 4-stage ring; kept for the selftest's comparison:
// benchmarks/notes/grouped_matmul.md).
#include "grouped_matmul.h"

#include <cuda.h>
#include <cudaTypedefs.h>

namespace jax_dsa {
namespace gmm {
namespace {

constexpr int kBM = 128;  // output tile rows (2 consumer warpgroups x 64)
constexpr int kBN = 256;  // output tile columns
constexpr int kBK = 64;   // contraction per stage (one 128-byte swizzle row of bf16)
constexpr int kThreads = 384;
constexpr int kABytes = kBM * kBK * 2;   // 16 KiB
constexpr int kBBytes = kBN * kBK * 2;   // 32 KiB
constexpr int kStageBytes = kABytes + kBBytes;
constexpr int kBlockBytes = 64 * 128;    // one [64 rows, 64 bf16] swizzled block: 8 KiB

enum Mode { kFwd = 0, kDgrad = 1, kWgrad = 2 };

constexpr int kStageOut = kBM * kBN * 2;  // the output tile staged for its TMA store: 64 KiB

// Dynamic shared memory: alignment slack, the ring, [the output staging], the group tables.
size_t SmemBytes(int num_groups, int stages, bool tma_store) {
  return 1024 + size_t(stages) * kStageBytes + (tma_store ? kStageOut : 0) +
         2 * size_t(num_groups + 1) * sizeof(int32_t);
}

// ---- PTX wrappers -------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarWait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra LAB_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// 2-D TMA load of one box at element coordinates (x inner, y outer) into shared memory.
__device__ __forceinline__ void TmaLoad(const CUtensorMap* map, uint32_t dst, uint32_t bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}
// 2-D TMA store of one box from shared memory (bulk group of the issuing thread).
__device__ __forceinline__ void TmaStore(const CUtensorMap* map, uint32_t src, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(x), "r"(y), "r"(src)
               : "memory");
}
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void ConsumerBarrier() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// wgmma shared-memory descriptors, 128-byte swizzle: 8-row groups 1024 bytes apart.
// K-major: the row is the M/N index, 64 contraction elements a row (leading offset unused).
__device__ __forceinline__ uint64_t DescK(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// MN-major: the row is the contraction index; 64-element M/N blocks `lbo` bytes apart.
__device__ __forceinline__ uint64_t DescMN(uint32_t addr, uint32_t lbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}
__device__ __forceinline__ void WgFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void WgFenceOperand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d[128] (+)= A (64 x 16) . B (256 x 16)^T, both from shared memory.
template <int TA, int TB>
__device__ __forceinline__ void WgMma256(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

// ---- prep: clamped offsets and tile prefix sums ------------------------------------------------
// Workspace (int32): off[0..G] (off[g] = first row of group g, clamped as grouped_matmul.h says),
// then tp[0..G] (tp[g] = m-tiles of the groups before g, kBM rows a tile).
template <typename T>
__device__ T BlockInclusiveScan(T v, T* warp_tot) {  // 1024 threads
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  if (lane == 31) warp_tot[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = warp_tot[lane];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const T u = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += u;
    }
    warp_tot[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += warp_tot[warp - 1];
  __syncthreads();
  return v;
}

__global__ void __launch_bounds__(1024) PrepKernel(const int32_t* __restrict__ sizes, int num_groups, int64_t m,
                                                   int32_t* __restrict__ ws) {
  __shared__ long long tot64[32];
  __shared__ int tot32[32];
  const int g = threadIdx.x;
  const long long s = g < num_groups ? (long long)max(0, sizes[g]) : 0ll;
  const long long incl = BlockInclusiveScan<long long>(s, tot64);
  const int end = int(min(incl, (long long)m));
  const int start = int(min(incl - s, (long long)m));
  const int tiles = (end - start + kBM - 1) / kBM;
  const int tincl = BlockInclusiveScan<int>(tiles, tot32);
  if (g < num_groups) {
    ws[g + 1] = end;
    ws[num_groups + 1 + g + 1] = tincl;
  }
  if (g == 0) {
    ws[0] = 0;
    ws[num_groups + 1] = 0;
  }
}

// ---- the grouped GEMM ---------------------------------------------------------------------------
struct Params {
  int m;        // rows of lhs / d_out
  int kc;       // kFwd / kDgrad: contraction length (K / N)
  int k;        // K: rows of one expert's rhs (kFwd / kDgrad: B's row offset per group; kWgrad: out rows)
  int n_out;    // columns of the output (kFwd: N, kDgrad: K, kWgrad: N)
  int groups;
  int mt;       // kWgrad: m-tiles over K
  int nt;       // n-tiles over n_out
};

struct Tile {
  int g, row0, row_end, m0, n0, nk;
};

template <int MODE>
__device__ __forceinline__ Tile GetTile(int t, const Params& p, const int32_t* off, const int32_t* tp) {
  Tile tl;
  if constexpr (MODE == kWgrad) {
    const int per_g = p.mt * p.nt;
    tl.g = t / per_g;
    const int r = t - tl.g * per_g;
    tl.m0 = (r / p.nt) * kBM;
    tl.n0 = (r % p.nt) * kBN;
    tl.row0 = off[tl.g];
    tl.row_end = off[tl.g + 1];
    tl.nk = (tl.row_end - tl.row0 + kBK - 1) / kBK;
  } else {
    const int mt = t / p.nt;
    tl.n0 = (t - mt * p.nt) * kBN;
    int lo = 0, hi = p.groups - 1;  // the last g with tp[g] <= mt
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (tp[mid] <= mt) lo = mid; else hi = mid - 1;
    }
    tl.g = lo;
    tl.row0 = off[lo] + (mt - tp[lo]) * kBM;
    tl.row_end = off[lo + 1];
    tl.m0 = 0;
    tl.nk = p.kc / kBK;
  }
  return tl;
}

// STAGES: depth of the ring. TMA_STORE: full 64-row halves of a tile go out through shared memory
// and TMA stores (asynchronous: the next tile's MMAs start while they drain); other rows (a group's
// last, partial m-tile) by direct masked stores.
template <int MODE, int STAGES, bool TMA_STORE>
__global__ void __launch_bounds__(kThreads, 1)
GmmKernel(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b,
          const __grid_constant__ CUtensorMap tm_c, const int32_t* __restrict__ ws,
          __nv_bfloat16* __restrict__ out, const Params p) {
  constexpr int kStages = STAGES;
  constexpr int TA = MODE == kWgrad ? 1 : 0;
  constexpr int TB = MODE == kDgrad ? 0 : 1;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages], empty_bar[kStages];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t ring = SmemAddr(smem);
  const uint32_t staging = ring + kStages * kStageBytes;  // TMA_STORE: 2 x 32 KiB
  int32_t* off = reinterpret_cast<int32_t*>(smem + kStages * kStageBytes + (TMA_STORE ? kStageOut : 0));
  int32_t* tp = off + p.groups + 1;
  const int tid = threadIdx.x;

  for (int i = tid; i < 2 * (p.groups + 1); i += kThreads) off[i] = ws[i];
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarInit(SmemAddr(&full_bar[i]), 1);
      MbarInit(SmemAddr(&empty_bar[i]), 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int total = MODE == kWgrad ? p.groups * p.mt * p.nt : tp[p.groups] * p.nt;

  const int wg = tid >> 7;
  if (wg == 0) {
    // Producer: one thread issues every TMA load.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&tm_b)) : "memory");
      int it = 0;
      for (int t = blockIdx.x; t < total; t += gridDim.x) {
        const Tile tl = GetTile<MODE>(t, p, off, tp);
        // Boxes wholly past the matrix edge are skipped (their columns / rows are never stored).
        int nb = 4, na = 2;
        if constexpr (MODE != kDgrad) nb = min(4, (p.n_out - tl.n0) / 64);
        if constexpr (MODE == kWgrad) na = min(2, (p.k - tl.m0) / 64);
        uint32_t bytes;
        if constexpr (MODE == kFwd) bytes = kABytes + nb * kBlockBytes;
        else if constexpr (MODE == kDgrad) bytes = kStageBytes;
        else bytes = (na + nb) * kBlockBytes;
        for (int kb = 0; kb < tl.nk; ++kb, ++it) {
          const int st = it % kStages;
          if (it >= kStages) MbarWait(SmemAddr(&empty_bar[st]), ((it / kStages) - 1) & 1);
          const uint32_t bar = SmemAddr(&full_bar[st]);
          const uint32_t sa = ring + st * kStageBytes, sb = sa + kABytes;
          MbarArriveExpectTx(bar, bytes);
          if constexpr (MODE == kFwd) {
            TmaLoad(&tm_a, sa, bar, kb * kBK, tl.row0);
            for (int j = 0; j < nb; ++j) TmaLoad(&tm_b, sb + j * kBlockBytes, bar, tl.n0 + 64 * j, tl.g * p.k + kb * kBK);
          } else if constexpr (MODE == kDgrad) {
            TmaLoad(&tm_a, sa, bar, kb * kBK, tl.row0);
            TmaLoad(&tm_b, sb, bar, kb * kBK, tl.g * p.k + tl.n0);
          } else {
            const int r = tl.row0 + kb * kBK;
            for (int j = 0; j < na; ++j) TmaLoad(&tm_a, sa + j * kBlockBytes, bar, tl.m0 + 64 * j, r);
            for (int j = 0; j < nb; ++j) TmaLoad(&tm_b, sb + j * kBlockBytes, bar, tl.n0 + 64 * j, r);
          }
        }
      }
    }
    return;
  }

  // Consumers: warpgroup cw owns output rows 64 cw + [0, 64) of the tile.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = wg - 1;
  const int ct = tid - 128;  // 0..255 over both consumers
  const int lane = tid & 31;
  const int wq = (tid >> 5) & 3;
  float acc[128];
  int it = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const Tile tl = GetTile<MODE>(t, p, off, tp);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int kb = 0; kb < tl.nk; ++kb, ++it) {
      const int st = it % kStages;
      MbarWait(SmemAddr(&full_bar[st]), (it / kStages) & 1);
      const uint32_t sa = ring + st * kStageBytes, sb = sa + kABytes;
      if constexpr (MODE == kWgrad) {
        const int valid = tl.row_end - (tl.row0 + kb * kBK);
        if (valid < kBK) {  // uniform over both consumers: zero rows [valid, 64) of A and B
          const int nrow = kBK - valid;
          for (int x = ct; x < 6 * nrow * 8; x += 256) {
            const int blk = x / (nrow * 8), rem = x - blk * nrow * 8;
            const uint32_t a = (blk < 2 ? sa + blk * kBlockBytes : sb + (blk - 2) * kBlockBytes) +
                               (valid + (rem >> 3)) * 128 + (rem & 7) * 16;
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(a), "r"(0) : "memory");
          }
          FenceProxyAsync();
          ConsumerBarrier();
        }
      }
      WgFenceOperand(acc);
      WgFence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        uint64_t da, db;
        if constexpr (TA) da = DescMN(sa + cw * kBlockBytes + ks * 2048, kBlockBytes);
        else da = DescK(sa + cw * kBlockBytes + ks * 32);
        if constexpr (TB) db = DescMN(sb + ks * 2048, kBlockBytes);
        else db = DescK(sb + ks * 32);
        WgMma256<TA, TB>(acc, da, db, 1);
      }
      WgCommit();
      WgFenceOperand(acc);
      WgWait<1>();
      WgFenceOperand(acc);
      if (kb > 0 && lane == 0) MbarArrive(SmemAddr(&empty_bar[(it - 1) % kStages]));
    }
    WgWait<0>();
    WgFenceOperand(acc);
    if (tl.nk > 0 && lane == 0) MbarArrive(SmemAddr(&empty_bar[(it - 1) % kStages]));

    // Epilogue: accumulator (row r0 + 8h, columns 8b + 2q + {0,1}) = acc[4b + 2h + {0,1}].
    const int q = lane & 3;
    const int lr0 = 64 * cw + 16 * wq + (lane >> 2);
    if constexpr (TMA_STORE) {
      const bool whole = MODE == kWgrad ? tl.m0 + 64 * cw + 64 <= p.k : tl.row0 + 64 * cw + 64 <= tl.row_end;
      if (whole) {  // uniform over the warpgroup
        const uint32_t stg = staging + cw * (kStageOut / 2);  // 4 blocks [64 rows, 64 cols], swizzled
        const int wct = ct & 127;
        if (wct == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * wq + (lane >> 2) + 8 * h;
#pragma unroll
          for (int b = 0; b < 32; ++b) {
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * b + 2 * h], acc[4 * b + 2 * h + 1]);
            const uint32_t a = stg + (b >> 3) * kBlockBytes + r * 128 + (((b & 7) ^ (r & 7)) << 4) + 4 * q;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(a), "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
          }
        }
        FenceProxyAsync();
        asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
        if (wct == 0) {
          const int y = MODE == kWgrad ? tl.g * p.k + tl.m0 + 64 * cw : tl.row0 + 64 * cw;
          for (int blk = 0; blk < 4; ++blk)
            if (tl.n0 + 64 * blk < p.n_out) TmaStore(&tm_c, stg + blk * kBlockBytes, tl.n0 + 64 * blk, y);
          asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
        continue;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int lr = lr0 + 8 * h;
      bool row_ok;
      __nv_bfloat16* orow;
      if constexpr (MODE == kWgrad) {
        row_ok = tl.m0 + lr < p.k;
        orow = out + (int64_t(tl.g) * p.k + tl.m0 + lr) * p.n_out;
      } else {
        row_ok = tl.row0 + lr < tl.row_end;
        orow = out + int64_t(tl.row0 + lr) * p.n_out;
      }
      if (row_ok) {
#pragma unroll
        for (int b = 0; b < 32; ++b) {
          const int col = tl.n0 + 8 * b + 2 * q;
          if (col < p.n_out) {
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * b + 2 * h], acc[4 * b + 2 * h + 1]);
            *reinterpret_cast<__nv_bfloat162*>(orow + col) = v;
          }
        }
      }
    }
  }

  if constexpr (TMA_STORE) {
    if ((ct & 127) == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
  if constexpr (MODE != kWgrad) {
    // Rows [off[G], m) of the output are zeros.
    const int64_t first = int64_t(off[p.groups]) * p.n_out / 8;  // 16-byte chunks (n_out % 64 == 0)
    const int64_t last = int64_t(p.m) * p.n_out / 8;
    uint4* o = reinterpret_cast<uint4*>(out);
    for (int64_t i = first + int64_t(blockIdx.x) * 256 + ct; i < last; i += int64_t(gridDim.x) * 256)
      o[i] = make_uint4(0, 0, 0, 0);
  }
}

// ---- host ---------------------------------------------------------------------------------------
PFN_cuTensorMapEncodeTiled_v12000 EncodeFn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A row-major bf16 matrix [rows, cols] read in boxes of [box_rows, 64] with the 128-byte swizzle.
bool MakeMap(CUtensorMap* map, const void* ptr, uint64_t rows, uint64_t cols, uint32_t box_rows) {
  auto fn = EncodeFn();
  if (!fn) return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};
  const cuuint32_t box[2] = {64, box_rows};
  const cuuint32_t estr[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box, estr,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool Aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

const char* CheckCommon(const void* a, const void* b, const int32_t* sizes, const void* out, int64_t m, int64_t k,
                        int64_t n, int groups, const void* ws, size_t ws_bytes) {
  if (groups < 1 || groups > kMaxGroups) return "grouped_matmul: num_groups must be in [1, 1024]";
  if (m < 0 || m >= (int64_t(1) << 31)) return "grouped_matmul: m must be in [0, 2^31)";
  if (k < 64 || k % 64 != 0 || k >= (int64_t(1) << 31)) return "grouped_matmul: k must be a positive multiple of 64";
  if (n < 64 || n % 64 != 0 || n >= (int64_t(1) << 31)) return "grouped_matmul: n must be a positive multiple of 64";
  if (int64_t(groups) * k >= (int64_t(1) << 31)) return "grouped_matmul: num_groups * k must be < 2^31";
  if (!a || !b || !out || !sizes || !ws) return "grouped_matmul: null pointer";
  if (!Aligned(a) || !Aligned(b) || !Aligned(out) || !Aligned(ws)) return "grouped_matmul: pointers must be 16-byte aligned";
  if (ws_bytes < GroupedMatmulWorkspaceBytes(groups)) return "grouped_matmul: workspace too small";
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return "grouped_matmul: no CUDA device";
  if (major != 9 || minor != 0) return "grouped_matmul: needs an SM90 (compute capability 9.0) device";
  return nullptr;
}

#ifdef JAX_DSA_GMM_VARIANTS  // the selftest build only (JAX_DSA_CUDA_SELFTEST): not in the module
int g_variant = 1;  // 0: 4 stages, direct stores; 1: 3 stages, TMA stores
#endif

template <int MODE>
const char* Launch(const CUtensorMap& ta, const CUtensorMap& tb, const int32_t* sizes, __nv_bfloat16* out,
                   const Params& p, int64_t m, void* ws, cudaStream_t stream) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return "grouped_matmul: no SM count";
  // The output as TMA sees it: [rows, n_out] (kWgrad: [G * K, N]), boxes of [64, 64].
  CUtensorMap tc;
  if (!MakeMap(&tc, out, MODE == kWgrad ? uint64_t(p.groups) * p.k : uint64_t(m), p.n_out, 64))
    return "grouped_matmul: cuTensorMapEncodeTiled failed";
#ifdef JAX_DSA_GMM_VARIANTS
  const bool tma_store = g_variant == 1;
  auto kernel = tma_store ? GmmKernel<MODE, 3, true> : GmmKernel<MODE, 4, false>;
#else
  constexpr bool tma_store = true;
  auto kernel = GmmKernel<MODE, 3, true>;
#endif
  const int stages = tma_store ? 3 : 4;
  const size_t smem = SmemBytes(p.groups, stages, tma_store);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  int32_t* w = static_cast<int32_t*>(ws);
  PrepKernel<<<1, 1024, 0, stream>>>(sizes, p.groups, m, w);
  if ((e = cudaGetLastError()) != cudaSuccess) return cudaGetErrorString(e);
  int grid = sms;
  if (MODE == kWgrad) grid = int(std::min<int64_t>(sms, int64_t(p.groups) * p.mt * p.nt));
  kernel<<<grid, kThreads, smem, stream>>>(ta, tb, tc, w, out, p);
  if ((e = cudaGetLastError()) != cudaSuccess) return cudaGetErrorString(e);
  return nullptr;
}

}  // namespace

#ifdef JAX_DSA_GMM_VARIANTS
void SetVariantForTesting(int v) { g_variant = v; }
#endif

size_t GroupedMatmulWorkspaceBytes(int num_groups) {
  return (2 * size_t(num_groups + 1) * sizeof(int32_t) + 255) / 256 * 256;
}

const char* GroupedMatmulFwd(const __nv_bfloat16* lhs, const __nv_bfloat16* rhs, const int32_t* group_sizes,
                             __nv_bfloat16* out, int64_t m, int64_t k, int64_t n, int num_groups, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  if (const char* err = CheckCommon(lhs, rhs, group_sizes, out, m, k, n, num_groups, workspace, workspace_bytes)) return err;
  if (m == 0) return nullptr;
  CUtensorMap ta, tb;
  if (!MakeMap(&ta, lhs, m, k, kBM) || !MakeMap(&tb, rhs, uint64_t(num_groups) * k, n, 64))
    return "grouped_matmul: cuTensorMapEncodeTiled failed";
  const Params p{int(m), int(k), int(k), int(n), num_groups, 0, int((n + kBN - 1) / kBN)};
  return Launch<kFwd>(ta, tb, group_sizes, out, p, m, workspace, stream);
}

const char* GroupedMatmulDgrad(const __nv_bfloat16* d_out, const __nv_bfloat16* rhs, const int32_t* group_sizes,
                               __nv_bfloat16* d_lhs, int64_t m, int64_t k, int64_t n, int num_groups, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  if (const char* err = CheckCommon(d_out, rhs, group_sizes, d_lhs, m, k, n, num_groups, workspace, workspace_bytes)) return err;
  if (m == 0) return nullptr;
  CUtensorMap ta, tb;
  if (!MakeMap(&ta, d_out, m, n, kBM) || !MakeMap(&tb, rhs, uint64_t(num_groups) * k, n, kBN))
    return "grouped_matmul: cuTensorMapEncodeTiled failed";
  const Params p{int(m), int(n), int(k), int(k), num_groups, 0, int((k + kBN - 1) / kBN)};
  return Launch<kDgrad>(ta, tb, group_sizes, d_lhs, p, m, workspace, stream);
}

const char* GroupedMatmulWgrad(const __nv_bfloat16* lhs, const __nv_bfloat16* d_out, const int32_t* group_sizes,
                               __nv_bfloat16* d_rhs, int64_t m, int64_t k, int64_t n, int num_groups, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  if (const char* err = CheckCommon(lhs, d_out, group_sizes, d_rhs, m, k, n, num_groups, workspace, workspace_bytes)) return err;
  if (m == 0) {
    const cudaError_t e = cudaMemsetAsync(d_rhs, 0, size_t(num_groups) * k * n * 2, stream);
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
  }
  CUtensorMap ta, tb;
  if (!MakeMap(&ta, lhs, m, k, 64) || !MakeMap(&tb, d_out, m, n, 64)) return "grouped_matmul: cuTensorMapEncodeTiled failed";
  const Params p{int(m), 0, int(k), int(n), num_groups, int((k + kBM - 1) / kBM), int((n + kBN - 1) / kBN)};
  return Launch<kWgrad>(ta, tb, group_sizes, d_rhs, p, m, workspace, stream);
}

}  // namespace gmm
}  // namespace jax_dsa
