// Standalone check and timing of the grouped matmuls (grouped_matmul.h), no XLA, no Python.
//   grouped_matmul_selftest            correctness: each product against a float64 host reference
//   grouped_matmul_selftest --bench    + times at GLM-5 dims, M = 131072, G 8 / 64 / 256
// Exit code 0 only when every check passes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/grouped_matmul/grouped_matmul.h"

using jax_dsa::gmm::GroupedMatmulDgrad;
using jax_dsa::gmm::GroupedMatmulFwd;
using jax_dsa::gmm::GroupedMatmulWgrad;
using jax_dsa::gmm::GroupedMatmulWorkspaceBytes;
using bf16 = __nv_bfloat16;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
      exit(2);                                                                             \
    }                                                                                      \
  } while (0)
#define CKS(x)                                                          \
  do {                                                                  \
    const char* s_ = (x);                                               \
    if (s_) {                                                           \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);    \
      exit(2);                                                          \
    }                                                                   \
  } while (0)

__global__ void FillKernel(bf16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 29; x *= 0x94D049BB133111EBull; x ^= x >> 32;
    p[i] = __float2bfloat16(float(int(x & 0xFFFFFF) - 0x800000) / float(0x800000));  // [-1, 1)
  }
}
void Fill(bf16* p, size_t n, uint64_t seed) {
  FillKernel<<<1024, 256>>>(p, n, seed);
  CK(cudaGetLastError());
}
void Poison(bf16* p, size_t n) { CK(cudaMemset(p, 0xFF, n * 2)); }  // bf16 0xFFFF: NaN

float B2F(bf16 v) { return __bfloat162float(v); }

void ParallelFor(int n, const std::function<void(int)>& f) {
  const int nt = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&, t] { for (int i = t; i < n; i += nt) f(i); });
  for (auto& x : th) x.join();
}

// The clamped offsets of grouped_matmul.h.
std::vector<int64_t> Offsets(const std::vector<int32_t>& sizes, int64_t m) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  int64_t s = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    s += std::max(0, sizes[g]);
    off[g + 1] = std::min(s, m);
  }
  return off;
}

struct Cmp {
  double num = 0, den = 0;
  int64_t bad = 0, nonfinite = 0, nonzero_where_zero = 0;
  double worst = 0;
};
// out vs ref; `zero[i]` marks elements that must be exactly 0.
void Compare(const std::vector<bf16>& out, const std::vector<double>& ref, const std::vector<char>& zero, Cmp& c) {
  double ss = 0;
  for (double r : ref) ss += r * r;
  const double rms = std::sqrt(ss / std::max<size_t>(1, ref.size()));
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = B2F(out[i]);
    if (!std::isfinite(o)) { ++c.nonfinite; continue; }
    if (zero[i]) { if (o != 0.0) ++c.nonzero_where_zero; continue; }
    const double d = std::fabs(o - ref[i]);
    c.num += d * d;
    c.den += ref[i] * ref[i];
    const double tol = 1.6e-2 * std::fabs(ref[i]) + 4e-3 * rms;
    if (d > tol) ++c.bad;
    c.worst = std::max(c.worst, d / (std::fabs(ref[i]) + rms));
  }
}
bool Report(const char* what, const char* name, const Cmp& c) {
  const double rel = c.den > 0 ? std::sqrt(c.num / c.den) : 0.0;
  const bool ok = rel <= 1e-2 && c.bad == 0 && c.nonfinite == 0 && c.nonzero_where_zero == 0;
  printf("  %-6s %-26s rel %.2e  bad %lld  nonfinite %lld  nonzero-in-zero %lld  worst %.2e  %s\n", what, name, rel,
         (long long)c.bad, (long long)c.nonfinite, (long long)c.nonzero_where_zero, c.worst, ok ? "ok" : "FAIL");
  return ok;
}

struct Case {
  std::string name;
  int64_t m, k, n;
  std::vector<int32_t> sizes;
};

std::vector<int32_t> Multinomial(int64_t rows, int g, std::mt19937_64& rng, double zero_frac = 0.0) {
  std::vector<int32_t> s(g, 0);
  std::vector<int> live;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < g; ++i) if (u(rng) >= zero_frac) live.push_back(i);
  if (live.empty()) live.push_back(0);
  std::uniform_int_distribution<int> pick(0, int(live.size()) - 1);
  for (int64_t r = 0; r < rows; ++r) ++s[live[pick(rng)]];
  return s;
}

bool RunCase(const Case& cs, uint64_t seed) {
  const int64_t M = cs.m, K = cs.k, N = cs.n;
  const int G = int(cs.sizes.size());
  printf("case %s: M %lld K %lld N %lld G %d\n", cs.name.c_str(), (long long)M, (long long)K, (long long)N, G);
  const auto off = Offsets(cs.sizes, M);
  bf16 *lhs, *rhs, *dout, *out, *dlhs, *drhs;
  int32_t* sizes;
  void* ws;
  const size_t wsb = GroupedMatmulWorkspaceBytes(G);
  CK(cudaMalloc(&lhs, std::max<int64_t>(1, M * K) * 2));
  CK(cudaMalloc(&rhs, G * K * N * 2));
  CK(cudaMalloc(&dout, std::max<int64_t>(1, M * N) * 2));
  CK(cudaMalloc(&out, std::max<int64_t>(1, M * N) * 2));
  CK(cudaMalloc(&dlhs, std::max<int64_t>(1, M * K) * 2));
  CK(cudaMalloc(&drhs, G * K * N * 2));
  CK(cudaMalloc(&sizes, G * 4));
  CK(cudaMalloc(&ws, wsb));
  Fill(lhs, M * K, seed + 1);
  Fill(rhs, G * K * N, seed + 2);
  Fill(dout, M * N, seed + 3);
  Poison(out, M * N);
  Poison(dlhs, M * K);
  Poison(drhs, G * K * N);
  CK(cudaMemset(ws, 0xAB, wsb));
  CK(cudaMemcpy(sizes, cs.sizes.data(), G * 4, cudaMemcpyHostToDevice));
  CKS(GroupedMatmulFwd(lhs, rhs, sizes, out, M, K, N, G, ws, wsb, 0));
  CKS(GroupedMatmulDgrad(dout, rhs, sizes, dlhs, M, K, N, G, ws, wsb, 0));
  CKS(GroupedMatmulWgrad(lhs, dout, sizes, drhs, M, K, N, G, ws, wsb, 0));
  CK(cudaDeviceSynchronize());

  std::vector<bf16> h_lhs(M * K), h_rhs(G * K * N), h_dout(M * N), h_out(M * N), h_dlhs(M * K), h_drhs(G * K * N);
  CK(cudaMemcpy(h_lhs.data(), lhs, M * K * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_rhs.data(), rhs, G * K * N * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dout.data(), dout, M * N * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_out.data(), out, M * N * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_dlhs.data(), dlhs, M * K * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(h_drhs.data(), drhs, G * K * N * 2, cudaMemcpyDeviceToHost));
  std::vector<double> fl(M * K), fr(G * K * N), fd(M * N);
  for (size_t i = 0; i < fl.size(); ++i) fl[i] = B2F(h_lhs[i]);
  for (size_t i = 0; i < fr.size(); ++i) fr[i] = B2F(h_rhs[i]);
  for (size_t i = 0; i < fd.size(); ++i) fd[i] = B2F(h_dout[i]);
  std::vector<int> row_group(M, -1);
  for (int g = 0; g < G; ++g)
    for (int64_t r = off[g]; r < off[g + 1]; ++r) row_group[r] = g;

  // Forward and dgrad references, by row.
  std::vector<double> r_out(M * N, 0.0), r_dlhs(M * K, 0.0), r_drhs(G * K * N, 0.0);
  std::vector<char> z_out(M * N, 0), z_dlhs(M * K, 0), z_drhs(G * K * N, 0);
  ParallelFor(int(M), [&](int r) {
    const int g = row_group[r];
    if (g < 0) {
      std::fill(z_out.begin() + r * N, z_out.begin() + (r + 1) * N, 1);
      std::fill(z_dlhs.begin() + r * K, z_dlhs.begin() + (r + 1) * K, 1);
      return;
    }
    const double* w = fr.data() + int64_t(g) * K * N;
    double* o = r_out.data() + r * N;
    for (int64_t k = 0; k < K; ++k) {
      const double a = fl[r * K + k];
      const double* wr = w + k * N;
      for (int64_t n = 0; n < N; ++n) o[n] += a * wr[n];
    }
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      const double* wr = w + k * N;
      const double* d = fd.data() + r * N;
      for (int64_t n = 0; n < N; ++n) s += d[n] * wr[n];
      r_dlhs[r * K + k] = s;
    }
  });
  // Wgrad reference, by (group, k).
  ParallelFor(int(G * K), [&](int gk) {
    const int g = gk / int(K);
    const int64_t k = gk % K;
    double* o = r_drhs.data() + (int64_t(g) * K + k) * N;
    if (off[g + 1] == off[g]) std::fill(z_drhs.begin() + (int64_t(g) * K + k) * N, z_drhs.begin() + (int64_t(g) * K + k + 1) * N, 1);
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      const double a = fl[r * K + k];
      const double* d = fd.data() + r * N;
      for (int64_t n = 0; n < N; ++n) o[n] += a * d[n];
    }
  });
  bool ok = true;
  Cmp c1, c2, c3;
  Compare(h_out, r_out, z_out, c1);
  ok &= Report("fwd", cs.name.c_str(), c1);
  Compare(h_dlhs, r_dlhs, z_dlhs, c2);
  ok &= Report("dgrad", cs.name.c_str(), c2);
  Compare(h_drhs, r_drhs, z_drhs, c3);
  ok &= Report("wgrad", cs.name.c_str(), c3);
  for (void* p : {(void*)lhs, (void*)rhs, (void*)dout, (void*)out, (void*)dlhs, (void*)drhs, (void*)sizes, ws}) CK(cudaFree(p));
  return ok;
}

bool Correctness(bool small) {
  std::mt19937_64 rng(1234);
  std::vector<Case> cases;
  cases.push_back({"uneven-empty-tail", 700, 128, 192, {0, 300, 1, 250}});
  if (!small) {
    std::vector<int32_t> one(8, 0);
    one[5] = 1000;
    cases.push_back({"one-group-all-rows", 1000, 192, 256, one});
    cases.push_back({"G1-partial", 517, 64, 320, {517}});
    cases.push_back({"G8-multi-tile", 12000, 128, 512, Multinomial(11900, 8, rng)});
    cases.push_back({"G64-some-empty", 3000, 256, 128, Multinomial(2900, 64, rng, 0.2)});
    cases.push_back({"G256", 4096, 128, 192, Multinomial(4000, 256, rng)});
    cases.push_back({"clamped-neg-overflow", 900, 128, 128, {100, -50, 300, 700, 5, int32_t(-2147483647 - 1), 2147483647, 10}});
    cases.push_back({"overflow-sum", 600, 64, 128, {2147483647, 2147483647, 2147483647, 1}});
    cases.push_back({"all-empty", 300, 64, 64, {0, 0, 0}});
    cases.push_back({"G1024", 2048, 64, 64, Multinomial(2040, 1024, rng)});
  }
  bool ok = true;
  uint64_t seed = 0x5eed;
  for (const auto& c : cases) ok &= RunCase(c, seed += 101);
  printf("correctness: %s\n", ok ? "PASS" : "FAIL");
  return ok;
}

// ---- timing -------------------------------------------------------------------------------------
template <typename F>
float MedianMs(F&& f, int reps = 20) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Sampled float64 check of a bench-size product (a few hundred elements).
double SampleFwd(const bf16* lhs, const bf16* rhs, const bf16* out, const std::vector<int64_t>& off, int64_t K, int64_t N,
                 std::mt19937_64& rng) {
  double num = 0, den = 0;
  std::vector<bf16> a(K), b(K);
  bf16 o;
  const int G = int(off.size()) - 1;
  for (int s = 0; s < 64; ++s) {
    const int64_t r = std::uniform_int_distribution<int64_t>(0, off[G] - 1)(rng);
    const int64_t c = std::uniform_int_distribution<int64_t>(0, N - 1)(rng);
    const int g = int(std::upper_bound(off.begin(), off.end(), r) - off.begin()) - 1;
    CK(cudaMemcpy(a.data(), lhs + r * K, K * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy2D(b.data(), 2, rhs + int64_t(g) * K * N + c, N * 2, 2, K, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&o, out + r * N + c, 2, cudaMemcpyDeviceToHost));
    double ref = 0;
    for (int64_t k = 0; k < K; ++k) ref += double(B2F(a[k])) * B2F(b[k]);
    num += (B2F(o) - ref) * (B2F(o) - ref);
    den += ref * ref;
  }
  return std::sqrt(num / den);
}
double SampleWgrad(const bf16* lhs, const bf16* dout, const bf16* drhs, const std::vector<int64_t>& off, int64_t K,
                   int64_t N, std::mt19937_64& rng) {
  double num = 0, den = 0;
  const int G = int(off.size()) - 1;
  for (int s = 0; s < 32; ++s) {
    const int g = std::uniform_int_distribution<int>(0, G - 1)(rng);
    const int64_t k = std::uniform_int_distribution<int64_t>(0, K - 1)(rng);
    const int64_t n = std::uniform_int_distribution<int64_t>(0, N - 1)(rng);
    const int64_t rows = off[g + 1] - off[g];
    std::vector<bf16> a(std::max<int64_t>(1, rows)), b(std::max<int64_t>(1, rows));
    if (rows > 0) {
      CK(cudaMemcpy2D(a.data(), 2, lhs + off[g] * K + k, K * 2, 2, rows, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy2D(b.data(), 2, dout + off[g] * N + n, N * 2, 2, rows, cudaMemcpyDeviceToHost));
    }
    bf16 o;
    CK(cudaMemcpy(&o, drhs + (int64_t(g) * K + k) * N + n, 2, cudaMemcpyDeviceToHost));
    double ref = 0;
    for (int64_t r = 0; r < rows; ++r) ref += double(B2F(a[r])) * B2F(b[r]);
    num += (B2F(o) - ref) * (B2F(o) - ref);
    den += ref * ref;
  }
  return std::sqrt(num / den);
}

bool Bench() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("\nbench on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  const int64_t M = 131072, D = 6144, F = 2048;
  struct Shape { const char* name; int64_t k, n; };
  const Shape shapes[2] = {{"gate_up K6144 N4096", D, 2 * F}, {"down    K2048 N6144", F, D}};
  const int Gs[3] = {8, 64, 256};
  const int64_t maxkn = D * 2 * F;  // 6144 x 4096 = the largest expert
  bf16 *lhs, *dout, *out, *dlhs, *rhs, *drhs;
  int32_t* sizes;
  void* ws;
  const size_t wsb = GroupedMatmulWorkspaceBytes(1024);
  CK(cudaMalloc(&lhs, M * D * 2));
  CK(cudaMalloc(&dout, M * D * 2));
  CK(cudaMalloc(&out, M * D * 2));
  CK(cudaMalloc(&dlhs, M * D * 2));
  CK(cudaMalloc(&rhs, 256 * maxkn * 2));
  CK(cudaMalloc(&drhs, 256 * maxkn * 2));
  CK(cudaMalloc(&sizes, 1024 * 4));
  CK(cudaMalloc(&ws, wsb));
  Fill(lhs, M * D, 11);
  Fill(dout, M * D, 12);
  Fill(rhs, 256 * maxkn, 13);
  Poison(out, M * D);
  Poison(dlhs, M * D);
  Poison(drhs, 256 * maxkn);
  std::mt19937_64 rng(99);
  bool ok = true;
  // Dense: the forward kernel at G = 1 (same FLOPs as each product of the shape).
  double dense_ms[2];
  {
    const int32_t all = int32_t(M);
    CK(cudaMemcpy(sizes, &all, 4, cudaMemcpyHostToDevice));
    for (int s = 0; s < 2; ++s) {
      const auto& sh = shapes[s];
      dense_ms[s] = MedianMs([&] { CKS(GroupedMatmulFwd(lhs, rhs, sizes, out, M, sh.k, sh.n, 1, ws, wsb, 0)); });
      printf("dense (G=1 fwd kernel) %s: %.3f ms  %.1f TFLOP/s\n", sh.name, dense_ms[s],
             2.0 * M * sh.k * sh.n / dense_ms[s] * 1e-9);
    }
  }
  printf("%-5s %-20s %9s %9s %9s   (ms / TFLOP/s)\n", "G", "shape", "fwd", "dgrad", "wgrad");
  for (int G : Gs) {
    const auto hs = Multinomial(M, G, rng);
    CK(cudaMemcpy(sizes, hs.data(), G * 4, cudaMemcpyHostToDevice));
    const auto off = Offsets(hs, M);
    double tot_ms = 0, tot_flop = 0, dense_tot = 0;
    for (int s = 0; s < 2; ++s) {
      const auto& sh = shapes[s];
      const double flop = 2.0 * M * sh.k * sh.n;
      const float f = MedianMs([&] { CKS(GroupedMatmulFwd(lhs, rhs, sizes, out, M, sh.k, sh.n, G, ws, wsb, 0)); });
      const float d = MedianMs([&] { CKS(GroupedMatmulDgrad(dout, rhs, sizes, dlhs, M, sh.k, sh.n, G, ws, wsb, 0)); });
      const float w = MedianMs([&] { CKS(GroupedMatmulWgrad(lhs, dout, sizes, drhs, M, sh.k, sh.n, G, ws, wsb, 0)); });
      printf("%-5d %-20s %9.3f %9.3f %9.3f   %6.1f %6.1f %6.1f TFLOP/s\n", G, sh.name, f, d, w, flop / f * 1e-9,
             flop / d * 1e-9, flop / w * 1e-9);
      // sampled float64 checks at this size
      const double e1 = SampleFwd(lhs, rhs, out, off, sh.k, sh.n, rng);
      const double e3 = SampleWgrad(lhs, dout, drhs, off, sh.k, sh.n, rng);
      printf("      sampled rel err: fwd %.2e wgrad %.2e\n", e1, e3);
      ok &= e1 < 1e-2 && e3 < 1e-2;
      tot_ms += f + d + w;
      tot_flop += 3 * flop;
      dense_tot += 3 * dense_ms[s];
    }
    printf("G %-4d routed-experts mix fwd+bwd: %.2f ms, %.1f TFLOP/s; dense same FLOPs (G=1 kernel) %.1f TFLOP/s: %.2fx\n",
           G, tot_ms, tot_flop / tot_ms * 1e-9, tot_flop / dense_tot * 1e-9, dense_tot / tot_ms);
  }
  for (void* p : {(void*)lhs, (void*)dout, (void*)out, (void*)dlhs, (void*)rhs, (void*)drhs, (void*)sizes, ws}) CK(cudaFree(p));
  printf("bench sampled checks: %s\n", ok ? "PASS" : "FAIL");
  return ok;
}

int main(int argc, char** argv) {
  bool bench = false, small = false, bench_only = false;
  int variant = -1;  // -1: both
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--bench")) bench = true;
    if (!strcmp(argv[i], "--bench-only")) bench = bench_only = true;
    if (!strcmp(argv[i], "--small")) small = true;  // one case (for compute-sanitizer)
    if (!strcmp(argv[i], "--variant") && i + 1 < argc) variant = atoi(argv[++i]);
  }
  bool ok = true;
  for (int v = 0; v < 2; ++v) {
    if (variant >= 0 && v != variant) continue;
    jax_dsa::gmm::SetVariantForTesting(v);
    printf("=== variant %d (%s)\n", v, v == 0 ? "4 stages, direct stores" : "3 stages, TMA stores");
    if (!bench_only) ok &= Correctness(small);
    if (bench) ok &= Bench();
  }
  printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
  return ok ? 0 : 1;
}
