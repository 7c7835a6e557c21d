// Standalone check of the KL-loss launch code without XLA, for compute-sanitizer (development
// only; JAX_DSA_INDEXER_SELFTEST=ON builds it): random inputs, both kernels, every error checked.
//   compute-sanitizer --tool memcheck ./kl_loss_selftest; compute-sanitizer --tool racecheck ./kl_loss_selftest
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <cuda_bf16.h>
#include "kl_loss.h"
using namespace jax_dsa::indexer_kl;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("FAIL %s: %s at %s:%d\n", #x, cudaGetErrorString(e), __FILE__, __LINE__); exit(1);} } while (0)
template <typename T> T* up(const std::vector<T>& v) { T* p; CK(cudaMalloc(&p, v.size() * sizeof(T) + 16)); CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice)); return p; }
int run(int nb, int s_q, int s_kv, int h, int d, int h_i, int k, bool seg, int seed) {
  std::mt19937 g(seed); std::normal_distribution<float> n; std::uniform_real_distribution<float> u;
  int64_t t = int64_t(nb) * s_q, nkv = int64_t(nb) * s_kv;
  auto bf = [&](size_t cnt) { std::vector<__nv_bfloat16> v(cnt); for (auto& x : v) x = __float2bfloat16(n(g)); return v; };
  auto q = bf(t * h * d), kv = bf(nkv * d), iq = bf(t * h_i * 128), ik = bf(nkv * 128);
  std::vector<float> w(t * h_i); for (auto& x : w) x = n(g) * 0.01f;
  std::vector<int> idx(t * k), qp(t), kp(nkv), qs(t), ks(nkv);
  for (int64_t i = 0; i < t; ++i) { qp[i] = (i % s_q) + (s_kv - s_q); qs[i] = qp[i] > s_kv / 2; }
  for (int64_t i = 0; i < nkv; ++i) { kp[i] = i % s_kv; ks[i] = kp[i] > s_kv / 2; }
  for (int64_t i = 0; i < t * k; ++i) { float r = u(g); idx[i] = r < 0.1f ? -1 : (r < 0.12f ? s_kv + 2 : int(u(g) * s_kv)); }
  for (int j = 0; j < k; ++j) idx[j] = -1;  // row 0 empty
  std::vector<float> ds(t * k); for (auto& x : ds) x = n(g) * 1e-3f;
  FwdArgs a{up(q), up(kv), up(iq), up(ik), up(w), up(idx), up(qp), up(kp), seg ? up(qs) : nullptr, seg ? up(ks) : nullptr,
            nullptr, nullptr, t, h, d, h_i, k, s_q, s_kv, 0.05f};
  int64_t groups = (h + 63) / 64;
  CK(cudaMalloc(&a.mass, groups * t * k * 4)); CK(cudaMalloc(&a.score, t * k * 4));
  if (const char* why = FwdUnsupported(a)) { printf("unsupported: %s\n", why); return 1; }
  CK(LaunchFwd(a, 0)); CK(cudaDeviceSynchronize());
  BwdArgs b{a.iq, a.ik, a.w, a.idx, up(ds), nullptr, nullptr, nullptr, t, h_i, k, s_q, s_kv};
  CK(cudaMalloc(&b.d_iq, t * h_i * 128 * 4)); CK(cudaMalloc(&b.d_ik, nkv * 128 * 4)); CK(cudaMalloc(&b.d_w, t * h_i * 4));
  if (const char* why = BwdUnsupported(b)) { printf("unsupported: %s\n", why); return 1; }
  CK(LaunchBwd(b, 0)); CK(cudaDeviceSynchronize());
  std::vector<float> m(groups * t * k); CK(cudaMemcpy(m.data(), a.mass, m.size() * 4, cudaMemcpyDeviceToHost));
  double s = 0; for (int64_t i = 0; i < t * k; ++i) s += m[i];
  printf("case nb=%d s_q=%d s_kv=%d h=%d d=%d h_i=%d k=%d seg=%d: mass sum (group 0) %.3f over %lld rows\n", nb, s_q, s_kv, h, d, h_i, k, int(seg), s, (long long)t);
  return 0;
}
int main() {
  int r = 0;
  r |= run(2, 37, 50, 80, 512, 5, 300, true, 1);
  r |= run(1, 9, 3000, 64, 576, 32, 2048, false, 2);
  r |= run(1, 11, 11, 16, 576, 64, 37, true, 3);
  printf(r ? "harness FAILED\n" : "harness ok\n");
  return r;
}
