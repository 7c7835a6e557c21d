// Per-SM gather rate of 64-row kv blocks (1152-byte rows) from an L2-resident buffer into shared
// memory: cp.async 16 B (the kernel's producer) vs bulk copies vs TMA 2D row boxes (SW128).
// Build and run on an SM90 GPU: nvcc -O3 -arch=sm_90a -o gather_rate gather_rate.cu && ./gather_rate
// (prints JSON; results/memory_port_h200.json). A measurement for the notes, not part of the build.
// The last rows (row ids prefetched, 4 .. all SMs) show that a bare gather is limited by the L2
// shared by all SMs (~8.4 TB/s), not one SM's port (45-82 B/clk per SM while at most half the
// SMs gather). The forward kernel itself runs below that limit (benchmarks/notes/sparse_mla_fwd.md).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>

constexpr int ROW_BYTES = 1152, ROWS = 64, STAGE = ROWS * ROW_BYTES, CHUNKS = 9;

__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int c) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(b)), "r"(c)); }
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t tx) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(tx) : "memory"); }
__device__ __forceinline__ void mbar_wait(uint64_t* b, int ph) {
  asm volatile("{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@p bra.uni D;\nbra.uni W;\nD:\n}" ::"r"(su32(b)), "r"(ph) : "memory");
}
__device__ __forceinline__ int swz(int row, int col_bytes) {  // SW128 K-major, 8-row atoms, 64-col chunks down rows
  int off = row * 128 + (col_bytes % 128) + (col_bytes / 128) * (ROWS * 128);
  return off ^ ((off >> 3) & 0x70);
}

// mode 0: cp.async 16 B, 128 threads, NST stages in flight
__global__ void __launch_bounds__(128, 1) k_cpasync(const char* kv, const int* idx, int nblk, int nst, unsigned long long* cyc) {
  extern __shared__ __align__(1024) char smem[];
  int t = threadIdx.x, r_in = t / 8, c_in = t % 8;
  const int* my = idx + (size_t)blockIdx.x * nblk * ROWS;
  unsigned long long t0 = clock64();
  for (int b = 0; b < nblk; ++b) {
    char* st = smem + (b % nst) * STAGE;
    for (int i = 0; i < 4; ++i) {
      int row = r_in + 16 * i;
      const char* src = kv + (size_t)__ldg(my + b * ROWS + row) * ROW_BYTES;
      for (int j = 0; j < CHUNKS; ++j) {
        int cb = (c_in + 8 * j) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(su32(st + swz(row, cb))), "l"(src + cb));
      }
    }
    asm volatile("cp.async.commit_group;");
    if (nst == 1) asm volatile("cp.async.wait_group 0;");
    else if (nst == 2) asm volatile("cp.async.wait_group 1;");
    else asm volatile("cp.async.wait_group 2;");
  }
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();
  if (t == 0) cyc[blockIdx.x] = clock64() - t0;
}

// The same gather with each thread's row ids loaded one block ahead (as the kernel's producer
// does), on a grid of `gridDim.x` SMs: is the limit the SM's own port or the L2 shared by all?
__global__ void __launch_bounds__(128, 1) k_cpasync_prefetched(const char* kv, const int* idx, int nblk, unsigned long long* cyc) {
  extern __shared__ __align__(1024) char smem[];
  int t = threadIdx.x, r_in = t / 8, c_in = t % 8;
  const int* my = idx + (size_t)blockIdx.x * nblk * ROWS;
  int nxt[4];
  for (int i = 0; i < 4; ++i) nxt[i] = __ldg(my + r_in + 16 * i);
  unsigned long long t0 = clock64();
  for (int b = 0; b < nblk; ++b) {
    char* st = smem + (b % 2) * STAGE;
    int cur[4];
    for (int i = 0; i < 4; ++i) cur[i] = nxt[i];
    if (b + 1 < nblk)
      for (int i = 0; i < 4; ++i) nxt[i] = __ldg(my + (b + 1) * ROWS + r_in + 16 * i);
    for (int i = 0; i < 4; ++i) {
      int row = r_in + 16 * i;
      const char* src = kv + (size_t)cur[i] * ROW_BYTES;
#pragma unroll
      for (int j = 0; j < CHUNKS; ++j) {
        int cb = (c_in + 8 * j) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(su32(st + swz(row, cb))), "l"(src + cb));
      }
    }
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group 1;");
  }
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();
  if (t == 0) cyc[blockIdx.x] = clock64() - t0;
}

// mode 1: bulk copies (128-byte chunks, or whole 1152-byte rows when whole=1), one warp issues
// mode 2: TMA 2D box {64 cols, 1 row} SW128 (9 per row), one warp issues
__global__ void __launch_bounds__(128, 1) k_bulk(const char* kv, const int* idx, int nblk, int nst, int mode,
                                                 const __grid_constant__ CUtensorMap tmap, unsigned long long* cyc) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ uint64_t bar[4];
  int t = threadIdx.x;
  const int* my = idx + (size_t)blockIdx.x * nblk * ROWS;
  if (t == 0) for (int i = 0; i < 4; ++i) mbar_init(&bar[i], 1);
  asm volatile("fence.mbarrier_init.release.cluster;");
  __syncthreads();
  unsigned long long t0 = clock64();
  if (t < 32) {
    for (int b = 0; b < nblk; ++b) {
      int s = b % nst;
      if (b >= nst) mbar_wait(&bar[s], ((b / nst) - 1) & 1);
      char* st = smem + s * STAGE;
      if (t == 0) mbar_expect(&bar[s], STAGE);
      __syncwarp();
      for (int r = t; r < ROWS; r += 32) {
        int row = __ldg(my + b * ROWS + r);
        const char* src = kv + (size_t)row * ROW_BYTES;
        if (mode == 1) {
          for (int j = 0; j < CHUNKS; ++j)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 128, [%2];"
                         ::"r"(su32(st + r * 128 + j * ROWS * 128)), "l"(src + j * 128), "r"(su32(&bar[s])) : "memory");
        } else if (mode == 3) {
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1152, [%2];"
                       ::"r"(su32(st + r * ROW_BYTES)), "l"(src), "r"(su32(&bar[s])) : "memory");
        } else {
          for (int j = 0; j < CHUNKS; ++j)
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                         ::"r"(su32(st + r * 128 + j * ROWS * 128)), "l"(&tmap), "r"(j * 64), "r"(row), "r"(su32(&bar[s])) : "memory");
        }
      }
    }
    for (int b = (nblk > nst ? nblk - nst : 0); b < nblk; ++b) mbar_wait(&bar[b % nst], (b / nst) & 1);
  }
  __syncthreads();
  if (t == 0) cyc[blockIdx.x] = clock64() - t0;
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// Median CUDA-event time (ms) of 20 launches after 5 warm-ups, and the median CTA cycle count
// of the last launch.
template <class Launch>
static bool time_launch(Launch launch, int grid, const unsigned long long* cyc, double* med_ms, double* med_cyc) {
  std::vector<float> ms;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int rep = 0; rep < 25; ++rep) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    if (cudaEventSynchronize(e1) != cudaSuccess) return false;
    float x; cudaEventElapsedTime(&x, e0, e1); if (rep >= 5) ms.push_back(x);
  }
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  if (cudaGetLastError() != cudaSuccess) return false;
  std::sort(ms.begin(), ms.end());
  std::vector<unsigned long long> c(grid);
  if (cudaMemcpy(c.data(), cyc, grid * 8, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  std::sort(c.begin(), c.end());
  *med_ms = ms[ms.size() / 2];
  *med_cyc = (double)c[grid / 2];
  return true;
}

int main(int argc, char** argv) {
  int dev = 0; cudaDeviceProp p; CK(cudaGetDeviceProperties(&p, dev));
  int nsm = p.multiProcessorCount, nblk = 200;
  printf("{\"gpu\": \"%s\", \"sms\": %d, \"results\": [\n", p.name, nsm);
  bool first = true;
  for (int s_kv : {16384, 32768}) {
    char* kv; CK(cudaMalloc(&kv, (size_t)s_kv * ROW_BYTES));
    CK(cudaMemset(kv, 1, (size_t)s_kv * ROW_BYTES));
    std::vector<int> h((size_t)nsm * nblk * ROWS);
    std::mt19937 g(1); for (auto& x : h) x = g() % s_kv;
    int* idx; CK(cudaMalloc(&idx, h.size() * 4)); CK(cudaMemcpy(idx, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    unsigned long long* cyc; CK(cudaMalloc(&cyc, nsm * 8));
    CUtensorMap tm;
    cuuint64_t dims[2] = {576, (cuuint64_t)s_kv}; cuuint64_t strides[1] = {ROW_BYTES};
    cuuint32_t box[2] = {64, 1}, es[2] = {1, 1};
    typedef CUresult (*Enc)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    void* fp = nullptr; cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fp, cudaEnableDefault, &q));
    CUresult cr = ((Enc)fp)(&tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, kv, dims, strides, box, es,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (cr != CUDA_SUCCESS) { printf("tmap encode failed %d\n", (int)cr); return 1; }
    const char* names[] = {"cp.async16", "bulk128", "tma2d_sw128", "bulk_row1152"};
    for (int mode = 0; mode < 4; ++mode)
      for (int nst = 1; nst <= 3; ++nst) {
        int smem = 3 * STAGE;  // always one CTA per SM, whatever the stages in flight
        if (mode == 0) CK(cudaFuncSetAttribute(k_cpasync, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * STAGE));
        else CK(cudaFuncSetAttribute(k_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * STAGE));
        double med, cy;
        bool ok = time_launch([&] {
          if (mode == 0) k_cpasync<<<nsm, 128, smem>>>(kv, idx, nblk, nst, cyc);
          else k_bulk<<<nsm, 128, smem>>>(kv, idx, nblk, nst, mode, tm, cyc);
        }, nsm, cyc, &med, &cy);
        if (!ok) { printf("launch failed\n"); return 1; }
        double bytes = (double)nsm * nblk * STAGE;
        printf("%s{\"s_kv\": %d, \"mode\": \"%s\", \"stages_in_flight\": %d, \"ms\": %.4f, \"TB_s\": %.3f, \"B_per_clk_per_sm\": %.2f, \"clk_ghz\": %.3f}",
               first ? "" : ",\n", s_kv, names[mode], nst, med, bytes / med / 1e9, nblk * STAGE / cy, cy / (med * 1e6));
        first = false;
      }
    // row ids prefetched, 2 blocks in flight, on 4 .. all SMs
    CK(cudaFuncSetAttribute(k_cpasync_prefetched, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * STAGE));
    for (int grid : {4, 16, 33, 66, nsm}) {
      double med, cy;
      if (!time_launch([&] { k_cpasync_prefetched<<<grid, 128, 3 * STAGE>>>(kv, idx, nblk, cyc); }, grid, cyc, &med, &cy)) {
        printf("launch failed\n"); return 1;
      }
      printf(",\n{\"s_kv\": %d, \"mode\": \"cp.async16, row ids prefetched\", \"sms\": %d, \"ms\": %.4f, \"TB_s\": %.3f, \"B_per_clk_per_sm\": %.2f, \"clk_ghz\": %.3f}",
             s_kv, grid, med, (double)grid * nblk * STAGE / med / 1e9, nblk * STAGE / cy, cy / (med * 1e6));
    }
    cudaFree(kv); cudaFree(idx); cudaFree(cyc);
  }
  printf("\n]}\n");
  return 0;
}
