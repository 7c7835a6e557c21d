// Per-SM rate of writing a 64 KB output tile from shared to global memory, a few SMs at a time
// (as at staggered tile boundaries) and all SMs at once.
// Build and run on an SM90 GPU: nvcc -O3 -arch=sm_90a -o store_rate store_rate.cu && ./store_rate
// (prints JSON; results/memory_port_h200.json). A measurement for the notes, not part of the build.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
constexpr int TILE = 65536;
__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__global__ void __launch_bounds__(256, 1) k_store(char* out, int nrep, int mode, int nthr, unsigned long long* cyc) {
  extern __shared__ __align__(1024) char smem[];
  int t = threadIdx.x;
  for (int i = t; i < TILE / 4; i += blockDim.x) ((int*)smem)[i] = i;
  __syncthreads();
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  unsigned long long t0 = clock64();
  for (int r = 0; r < nrep; ++r) {
    char* dst = out + ((size_t)blockIdx.x * nrep + r) * TILE;
    if (mode <= 1) {
      if (t < nthr) {
        for (int off = t * 16; off < TILE; off += nthr * 16) {
          uint32_t a, b, c, d;
          asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(su32(smem + off)));
          if (mode == 0) asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};" ::"l"(dst + off), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
          else asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(dst + off), "r"(a), "r"(b), "r"(c), "r"(d), "l"(pol) : "memory");
        }
      }
    } else {
      int sz = mode == 2 ? 1024 : 512;
      if (t < 32) {
        for (int off = t * sz; off < TILE; off += 32 * sz)
          asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;" ::"l"(dst + off), "r"(su32(smem + off)), "r"(sz), "l"(pol) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n\tcp.async.bulk.wait_group.read 0;" ::: "memory");
      }
    }
    __syncthreads();
  }
  if (t == 0) cyc[blockIdx.x] = clock64() - t0;
}

int main() {
  int nsm; cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
  int nrep = 64;
  char* out; cudaMalloc(&out, (size_t)nsm * nrep * TILE);
  unsigned long long* cyc; cudaMalloc(&cyc, nsm * 8);
  cudaFuncSetAttribute(k_store, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  const char* names[] = {"st.global.v4", "st.global.v4.evict_first", "bulk1024", "bulk512"};
  printf("[\n");
  bool first = true;
  for (int ctas : {4, 16, 132})
    for (int mode = 0; mode < 4; ++mode)
      for (int nthr : {128, 256}) {
        if (mode >= 2 && nthr == 256) continue;
        std::vector<float> ms;
        for (int rep = 0; rep < 12; ++rep) {
          cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
          cudaEventRecord(e0);
          k_store<<<ctas, 256, 200 * 1024>>>(out, nrep, mode, nthr, cyc);
          cudaEventRecord(e1); cudaEventSynchronize(e1);
          float x; cudaEventElapsedTime(&x, e0, e1); if (rep >= 2) ms.push_back(x);
        }
        std::vector<unsigned long long> c(ctas); cudaMemcpy(c.data(), cyc, ctas * 8, cudaMemcpyDeviceToHost);
        std::sort(c.begin(), c.end()); std::sort(ms.begin(), ms.end());
        double cpt = (double)c[ctas / 2] / nrep;
        printf("%s{\"ctas\": %d, \"mode\": \"%s\", \"threads\": %d, \"cycles_per_64KB\": %.0f, \"B_per_clk_per_sm\": %.1f, \"TB_s\": %.2f}",
               first ? "" : ",\n", ctas, names[mode], nthr, cpt, TILE / cpt, (double)ctas * nrep * TILE / (ms[ms.size() / 2] * 1e9));
        first = false;
      }
  printf("\n]\n");
  cudaError_t e = cudaGetLastError(); if (e) printf("ERR %s\n", cudaGetErrorString(e));
}
