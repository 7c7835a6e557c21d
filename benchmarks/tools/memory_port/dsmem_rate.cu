// Does shared memory written by the other CTA of a cluster (distributed shared memory) arrive
// through the same per-SM port as loads from L2? Clusters of two CTAs, one per SM: warps 0-3 gather
// 64-row blocks of 1152-byte kv rows from L2 with 16-byte cp.async (as the kernel's producer),
// warps 4-7 write 64 KB blocks into the partner CTA's shared memory, with 16-byte
// st.shared::cluster from 128 threads or as 16 bulk copies of 4 KB (shared::cta to
// shared::cluster, completing on the partner's mbarrier); each alone, then with the gather.
// Rates per SM in bytes per SM cycle.
// Build and run on an SM90 GPU: nvcc -O3 -arch=sm_90a -o dsmem_rate dsmem_rate.cu && ./dsmem_rate
// (prints JSON; results/memory_port_h200.json). A measurement for the notes, not part of the build.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>

constexpr int ROW_BYTES = 1152, ROWS = 64, STAGE = ROWS * ROW_BYTES, CHUNKS = 9, DS = 65536;
__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// smem: [0, STAGE) gather target, [STAGE, STAGE + DS) DSMEM target written by the partner
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256, 1)
k_mix(const char* kv, const int* idx, int nblk, int mode, unsigned long long* cyc) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ uint64_t bar[2];  // block b arrives on bar[b % 2]; armed before the partner can send
  int t = threadIdx.x, w = t / 32;
  if (t == 0)
    for (int i = 0; i < 2; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su32(&bar[i])));
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(&bar[i])), "r"(DS) : "memory");
    }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  uint32_t remote, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(su32(smem + STAGE)), "r"(rank ^ 1));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote_bar) : "r"(su32(&bar[0])), "r"(rank ^ 1));
  asm volatile("barrier.cluster.arrive;\n\tbarrier.cluster.wait;" ::: "memory");
  unsigned long long t0 = clock64(), t1 = t0;
  if (w < 4 && (mode & 1)) {  // gather
    const int* my = idx + (size_t)blockIdx.x * nblk * ROWS;
    int r_in = t / 8, c_in = t % 8;
    for (int b = 0; b < nblk; ++b) {
      for (int i = 0; i < 4; ++i) {
        int row = r_in + 16 * i;
        const char* src = kv + (size_t)__ldg(my + b * ROWS + row) * ROW_BYTES;
        for (int j = 0; j < CHUNKS; ++j) {
          int cb = (c_in + 8 * j) * 16;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(su32(smem + row * ROW_BYTES + cb)), "l"(src + cb));
        }
      }
      asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 1;" ::: "memory");
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    t1 = clock64();
  } else if (w >= 4 && (mode & 4)) {  // DSMEM bulk copies: 16 x 4 KB per block
    for (int b = 0; b < nblk; ++b) {
      if (t == 128) {
        for (int k = 0; k < DS / 4096; ++k)
          asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                       ::"r"(remote + k * 4096), "r"(su32(smem + (k * 4096) % STAGE)), "r"(remote_bar + 8 * (b % 2)) : "memory");
        asm volatile("{\n.reg .pred p;\nW:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@p bra.uni D;\nbra.uni W;\nD:\n}"
                     ::"r"(su32(&bar[b % 2])), "r"((b / 2) & 1) : "memory");
        // armed for block b + 2 before this CTA sends block b + 1, the partner's trigger for it
        if (b + 2 < nblk)
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(&bar[b % 2])), "r"(DS) : "memory");
      }
    }
    t1 = clock64();
  } else if (w >= 4 && (mode & 2)) {  // DSMEM writes: 64 KB per block, same byte count as a block
    int u = t - 128;
    for (int b = 0; b < nblk; ++b) {
      for (int off = u * 16; off < DS; off += 128 * 16) {
        uint32_t a, bb, c, d;
        asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(bb), "=r"(c), "=r"(d) : "r"(su32(smem + (off % STAGE))));
        asm volatile("st.shared::cluster.v4.b32 [%0], {%1,%2,%3,%4};" ::"r"(remote + off), "r"(a), "r"(bb), "r"(c), "r"(d) : "memory");
      }
    }
    asm volatile("fence.acq_rel.cluster;" ::: "memory");
    t1 = clock64();
  }
  __syncthreads();
  if (t == 0 || t == 128) cyc[blockIdx.x * 2 + (t / 128)] = t1 - t0;
  asm volatile("barrier.cluster.arrive;\n\tbarrier.cluster.wait;" ::: "memory");
}

int main() {
  int nsm; cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0);
  int nblk = 200, s_kv = 32768, ctas = nsm & ~1;
  char* kv; cudaMalloc(&kv, (size_t)s_kv * ROW_BYTES); cudaMemset(kv, 1, (size_t)s_kv * ROW_BYTES);
  std::vector<int> h((size_t)ctas * nblk * ROWS); std::mt19937 g(1); for (auto& x : h) x = g() % s_kv;
  int* idx; cudaMalloc(&idx, h.size() * 4); cudaMemcpy(idx, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  unsigned long long* cyc; cudaMalloc(&cyc, ctas * 16);
  int smem = STAGE + DS;
  cudaFuncSetAttribute(k_mix, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const char* names[] = {"", "gather only", "dsmem st.shared::cluster only", "gather + dsmem st.shared::cluster",
                         "dsmem bulk only", "gather + dsmem bulk"};
  printf("[\n");
  for (int mode = 1; mode <= 5; ++mode) {
    for (int rep = 0; rep < 6; ++rep) k_mix<<<ctas, 256, smem>>>(kv, idx, nblk, mode, cyc);
    cudaError_t e = cudaDeviceSynchronize(); if (e) { printf("ERR %s\n", cudaGetErrorString(e)); return 1; }
    std::vector<unsigned long long> c(ctas * 2); cudaMemcpy(c.data(), cyc, ctas * 16, cudaMemcpyDeviceToHost);
    std::vector<unsigned long long> gth, dsm;
    for (int i = 0; i < ctas; ++i) { gth.push_back(c[2 * i]); dsm.push_back(c[2 * i + 1]); }
    std::sort(gth.begin(), gth.end()); std::sort(dsm.begin(), dsm.end());
    double g_rate = (mode & 1) ? (double)nblk * STAGE / gth[ctas / 2] : 0, d_rate = (mode & 6) ? (double)nblk * DS / dsm[ctas / 2] : 0;
    printf("%s{\"ctas\": %d, \"mode\": \"%s\", \"gather_B_per_clk_per_sm\": %.1f, \"dsmem_write_B_per_clk_per_sm\": %.1f}",
           mode == 1 ? "" : ",\n", ctas, names[mode], g_rate, d_rate);
    fflush(stdout);
  }
  printf("\n]\n");
}
