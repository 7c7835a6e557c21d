// Where do the CTAs of a persistent grid land? One CTA per SM (220 KB of shared memory, 384
// threads, as the forward kernel), 132 CTAs; each records %smid. For a plain launch and for
// launches with cluster dims 1, 2 and 4 it prints the SM of every CTA and how many CTA pairs
// (2k, 2k + 1) share a TPC (SMs 2t and 2t + 1), plus cudaOccupancyMaxActiveClusters.
// The forward kernel gives the two 64-head tiles of an H 128 query to CTAs 2k and 2k + 1, which
// then gather the same kv rows (benchmarks/notes/sparse_mla_fwd.md).
// Build and run on an SM90 GPU: nvcc -gencode=arch=compute_90a,code=sm_90a -o cta_placement
// cta_placement.cu && ./cta_placement (results/memory_port_h200.json, cta_placement).
// A measurement for the notes, not part of the build.
#include <cstdio>
#include <cuda_runtime.h>
__global__ void __launch_bounds__(384) k(int* out) {
  extern __shared__ char s[];
  unsigned smid; asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (threadIdx.x == 0) { out[blockIdx.x] = smid; s[0] = 1; }
  // hold the SM a while so that the grid is resident at once (all of it, except with clusters
  // of 4, of which only 30 fit: the rest land where those leave)
  long long t0 = clock64(); while (clock64() - t0 < 2000000) {}
}
int main() {
  int smem = 220 * 1024, n = 132, *d, h[264];
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaMalloc(&d, 264 * 4);
  k<<<n, 384, smem>>>(d); cudaDeviceSynchronize();
  cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost);
  printf("plain:"); for (int i = 0; i < n; i++) printf(" %d", h[i]); printf("\n");
  int same = 0; for (int i = 0; i < n; i += 2) same += (h[i] / 2 == h[i + 1] / 2); printf("plain pairs on one TPC (smid/2): %d of %d\n", same, n / 2);
  for (int cs = 1; cs <= 4; cs *= 2) {
    cudaLaunchConfig_t cfg = {}; cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = cs; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(n / cs * cs); cfg.blockDim = dim3(384); cfg.dynamicSmemBytes = smem; cfg.attrs = at; cfg.numAttrs = 1;
    int nc = -1; cudaError_t e = cudaOccupancyMaxActiveClusters(&nc, k, &cfg);
    printf("cluster %d: max active clusters %d (%s)\n", cs, nc, cudaGetErrorString(e));
    cudaMemset(d, 0xff, 264 * 4);
    e = cudaLaunchKernelEx(&cfg, k, d); cudaError_t e2 = cudaDeviceSynchronize();
    cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost);
    printf("cluster %d launch %s/%s:", cs, cudaGetErrorString(e), cudaGetErrorString(e2)); for (int i = 0; i < n / cs * cs; i++) printf(" %d", h[i]); printf("\n");
    int same2 = 0; for (int i = 0; i < n / cs * cs; i += 2) same2 += (h[i] / 2 == h[i + 1] / 2); printf("cluster %d pairs on one TPC: %d\n", cs, same2);
  }
  return 0;
}
