// Standalone check of the KL-loss launch code (ffi/cuda/indexer_kl_loss) without XLA, for
// compute-sanitizer and kernel timings (development only; built with JAX_DSA_CUDA_SELFTEST=ON):
// random inputs, both kernels, every error checked; the backward (sparse form: d_ik by bulk
// reductions at 32 index heads, red.v4 atomics at 64) and its dense form (dscore from the
// recomputed scores; two rows a CTA at <= 32 index heads) against a float64 reference.
//   ./kl_loss_selftest                      the cases below (exit status 1 on a failure)
//   ./kl_loss_selftest --bench [S]          the backward at S = S_q = S_kv (default 16384), 32 and
//                                           64 index heads, K 2048: CUDA-event medians of 10; the
//                                           dense form on a causal first key chunk
//   ./kl_loss_selftest --bench-dense [S]    the dense form alone (for ncu)
//   compute-sanitizer --tool memcheck ./kl_loss_selftest; ... --tool racecheck ...
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/indexer_kl_loss/launch.h"
using namespace jax_dsa::indexer_kl;
#define CK(x)                                                                                    \
  do {                                                                                           \
    cudaError_t e = (x);                                                                         \
    if (e != cudaSuccess) {                                                                      \
      printf("FAIL %s: %s at %s:%d\n", #x, cudaGetErrorString(e), __FILE__, __LINE__);          \
      exit(1);                                                                                   \
    }                                                                                            \
  } while (0)

template <typename T>
T* up(const std::vector<T>& v) {
  T* p;
  CK(cudaMalloc(&p, v.size() * sizeof(T) + 16));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <typename T>
std::vector<T> down(const T* p, size_t n) {
  std::vector<T> v(n);
  CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}
double RelL2(const std::vector<float>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

double Bf64(__nv_bfloat16 x) { return double(__bfloat162float(x)); }

// Kernel B's results in float64 (G unrounded) for dscore [T, K]; slots with an index outside
// [0, s_kv) add nothing.
struct RefGrads {
  std::vector<double> iq, ik, w;
};
RefGrads RefBackward(const std::vector<__nv_bfloat16>& iq, const std::vector<__nv_bfloat16>& ik,
                     const std::vector<float>& w, const std::vector<int>& idx,
                     const std::vector<double>& ds, int64_t t, int64_t nkv, int h_i, int k, int s_q,
                     int s_kv) {
  RefGrads r{std::vector<double>(t * h_i * 128, 0.0), std::vector<double>(nkv * 128, 0.0),
             std::vector<double>(t * h_i, 0.0)};
  for (int64_t q = 0; q < t; ++q) {
    const int64_t bb = q / s_q;
    for (int j = 0; j < k; ++j) {
      const int i = idx[q * k + j];
      const double dd = ds[q * k + j];
      if (i < 0 || i >= s_kv || dd == 0.0) continue;
      const int64_t row = bb * s_kv + i;
      for (int hh = 0; hh < h_i; ++hh) {
        double s = 0;
        for (int c = 0; c < 128; ++c) s += Bf64(iq[(q * h_i + hh) * 128 + c]) * Bf64(ik[row * 128 + c]);
        r.w[q * h_i + hh] += dd * std::max(s, 0.0);
        if (s <= 0) continue;
        const double gg = dd * w[q * h_i + hh];
        for (int c = 0; c < 128; ++c) {
          r.iq[(q * h_i + hh) * 128 + c] += gg * Bf64(ik[row * 128 + c]);
          r.ik[row * 128 + c] += gg * Bf64(iq[(q * h_i + hh) * 128 + c]);
        }
      }
    }
  }
  return r;
}

// Launches kernel B with b's inputs into fresh (NaN-poisoned) results and prints their rel L2
// against ref; with the dense form also checks its scores against ref_score (max |I - ref| /
// (1 + |ref|); -inf exactly on invalid slots). Returns 1 on a failure.
int CheckBwd(BwdArgs b, const RefGrads& ref, const std::vector<double>* ref_score, int64_t t,
             int64_t nkv, const char* what) {
  const int64_t h_i = b.h_i, k = b.k;
  CK(cudaMalloc(&b.d_iq, t * h_i * 128 * 4));
  CK(cudaMalloc(&b.d_ik, nkv * 128 * 4));
  CK(cudaMalloc(&b.d_w, t * h_i * 4));
  CK(cudaMemset(b.d_iq, 0xFF, t * h_i * 128 * 4));  // poison: NaN
  CK(cudaMemset(b.d_w, 0xFF, t * h_i * 4));
  if (ref_score) {
    CK(cudaMalloc(&b.score, t * k * 4));
    CK(cudaMemset(b.score, 0xFF, t * k * 4));
  }
  if (const char* why = BwdUnsupported(b)) {
    printf("unsupported: %s\n", why);
    return 1;
  }
  CK(LaunchBwd(b, 0));
  CK(cudaDeviceSynchronize());
  double e_s = 0;
  if (ref_score) {
    const std::vector<float> sc = down(b.score, size_t(t * k));
    for (int64_t i = 0; i < t * k; ++i) {
      const double r = (*ref_score)[i];
      if (r == -INFINITY)
        e_s = std::max(e_s, sc[i] == -INFINITY ? 0.0 : 1.0);
      else
        e_s = std::max(e_s, std::isfinite(sc[i]) ? std::abs(sc[i] - r) / (1 + std::abs(r)) : 1.0);
    }
    CK(cudaFree(b.score));
  }
  const double e_iq = RelL2(down(b.d_iq, size_t(t * h_i * 128)), ref.iq);
  const double e_ik = RelL2(down(b.d_ik, size_t(nkv * 128)), ref.ik);
  const double e_w = RelL2(down(b.d_w, size_t(t * h_i)), ref.w);
  const bool ok = e_s < 1e-5 && e_iq < 1e-2 && e_ik < 1e-2 && e_w < 1e-2;  // NaN fails the < tests
  char score_err[32] = "";
  if (ref_score) snprintf(score_err, sizeof(score_err), "score %.2e, ", e_s);
  printf("  bwd %s: %srel L2 d_iq %.2e d_ik %.2e d_w %.2e %s\n", what, score_err, e_iq, e_ik, e_w,
         ok ? "ok" : "FAIL");
  CK(cudaFree(b.d_iq));
  CK(cudaFree(b.d_ik));
  CK(cudaFree(b.d_w));
  return !ok;
}

// The backward's dense form (BwdArgs::index_lse): dscore = exp(I - lse) - target formed in the
// kernel, I written out; lse the float64 log-sum-exp over each row's valid slots, target random.
int dense(const FwdArgs& a, const std::vector<__nv_bfloat16>& iq, const std::vector<__nv_bfloat16>& ik,
          const std::vector<float>& w, const std::vector<int>& idx, int64_t t, int64_t nkv, int h_i,
          int k, int s_q, int s_kv, std::mt19937& g) {
  std::uniform_real_distribution<float> u;
  std::vector<double> r_score(t * k, -INFINITY), ds(t * k, 0.0);
  std::vector<float> lse(t, 0.f), target(t * k);
  for (auto& x : target) x = u(g) * 2e-3f;
  for (int64_t r = 0; r < t; ++r) {
    const int64_t bb = r / s_q;
    double mx = -INFINITY;
    for (int j = 0; j < k; ++j) {
      const int i = idx[r * k + j];
      if (i < 0 || i >= s_kv) continue;
      double sc = 0;
      for (int hh = 0; hh < h_i; ++hh) {
        double s = 0;
        for (int c = 0; c < 128; ++c) s += Bf64(iq[(r * h_i + hh) * 128 + c]) * Bf64(ik[(bb * s_kv + i) * 128 + c]);
        sc += w[r * h_i + hh] * std::max(s, 0.0);
      }
      r_score[r * k + j] = sc;
      mx = std::max(mx, sc);
    }
    double se = 0;
    for (int j = 0; j < k; ++j) se += r_score[r * k + j] == -INFINITY ? 0.0 : std::exp(r_score[r * k + j] - mx);
    lse[r] = se > 0 ? float(mx + std::log(se)) : 0.f;
    for (int j = 0; j < k; ++j)
      if (r_score[r * k + j] != -INFINITY) ds[r * k + j] = std::exp(r_score[r * k + j] - lse[r]) - target[r * k + j];
  }
  const RefGrads ref = RefBackward(iq, ik, w, idx, ds, t, nkv, h_i, k, s_q, s_kv);
  BwdArgs b{a.iq, a.ik, a.w, up(idx), nullptr, nullptr, nullptr, nullptr, t, h_i, k, s_q, s_kv};
  b.index_lse = up(lse);
  b.target = up(target);
  const int bad = CheckBwd(b, ref, &r_score, t, nkv, "dense form");
  CK(cudaFree((void*)b.idx));
  CK(cudaFree((void*)b.index_lse));
  CK(cudaFree((void*)b.target));
  return bad;
}

int run(int nb, int s_q, int s_kv, int h, int d, int h_i, int k, bool seg, int seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n;
  std::uniform_real_distribution<float> u;
  const int64_t t = int64_t(nb) * s_q, nkv = int64_t(nb) * s_kv;
  auto bf = [&](size_t cnt) {
    std::vector<__nv_bfloat16> v(cnt);
    for (auto& x : v) x = __float2bfloat16(n(g));
    return v;
  };
  auto q = bf(t * h * d), kv = bf(nkv * d), iq = bf(t * h_i * 128), ik = bf(nkv * 128);
  std::vector<float> w(t * h_i);
  for (auto& x : w) x = n(g) * 0.01f;
  std::vector<int> idx(t * k), qp(t), kp(nkv), qs(t), ks(nkv);
  for (int64_t i = 0; i < t; ++i) {
    qp[i] = (i % s_q) + (s_kv - s_q);
    qs[i] = qp[i] > s_kv / 2;
  }
  for (int64_t i = 0; i < nkv; ++i) {
    kp[i] = i % s_kv;
    ks[i] = kp[i] > s_kv / 2;
  }
  for (int64_t i = 0; i < t * k; ++i) {  // -1, out of range, duplicates
    const float r = u(g);
    idx[i] = r < 0.1f ? -1 : (r < 0.12f ? s_kv + 2 : int(u(g) * s_kv));
  }
  for (int j = 0; j < k; ++j) idx[j] = -1;  // row 0 empty
  std::vector<float> ds(t * k);
  for (auto& x : ds) x = n(g) * 1e-3f;
  FwdArgs a{up(q), up(kv), up(iq), up(ik), up(w), up(idx), up(qp), up(kp), seg ? up(qs) : nullptr,
            seg ? up(ks) : nullptr, nullptr, nullptr, t, h, d, h_i, k, s_q, s_kv, 0.05f};
  const int64_t groups = (h + 63) / 64;
  CK(cudaMalloc(&a.mass, groups * t * k * 4));
  CK(cudaMalloc(&a.score, t * k * 4));
  if (const char* why = FwdUnsupported(a)) {
    printf("unsupported: %s\n", why);
    return 1;
  }
  CK(LaunchFwd(a, 0));
  CK(cudaDeviceSynchronize());
  std::vector<float> m = down(a.mass, size_t(t * k));
  double msum = 0;
  for (float x : m) msum += x;

  const RefGrads ref = RefBackward(iq, ik, w, idx, std::vector<double>(ds.begin(), ds.end()), t,
                                   nkv, h_i, k, s_q, s_kv);
  float* dsp = up(ds);
  BwdArgs b{a.iq, a.ik, a.w, a.idx, dsp, nullptr, nullptr, nullptr, t, h_i, k, s_q, s_kv};
  int bad = CheckBwd(b, ref, nullptr, t, nkv, "sparse form");
  bad |= dense(a, iq, ik, w, idx, t, nkv, h_i, k, s_q, s_kv, g);
  // The dense form on chunk-like lists: each row's visible keys of its document (documents of
  // s_kv / 3 + 1 keys, causal) in order, from key k of the document on where the row sees more
  // than k; neighbours share a list except at document, chunk and batch boundaries.
  std::vector<int> chunk(t * k, -1);
  const int doc = s_kv / 3 + 1;
  for (int64_t r = 0; r < t; ++r) {
    const int p = qp[r], d0 = p / doc * doc, seen = p - d0 + 1, c0 = seen > k ? k : 0;
    for (int j = 0; j < std::min(seen - c0, k); ++j) chunk[r * k + j] = d0 + c0 + j;
  }
  bad |= dense(a, iq, ik, w, chunk, t, nkv, h_i, k, s_q, s_kv, g);
  printf("case nb=%d s_q=%d s_kv=%d h=%d d=%d h_i=%d k=%d seg=%d: mass sum (group 0) %.3f over %lld rows\n",
         nb, s_q, s_kv, h, d, h_i, k, int(seg), msum, (long long)t);
  return bad;
}

// CUDA-event times of kernel B on b's inputs: 12 launches, the first 2 dropped. Returns
// {median, min}, ms.
std::pair<float, float> TimeBwd(const BwdArgs& b) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < 12; ++rep) {
    CK(cudaEventRecord(e0));
    CK(LaunchBwd(b, 0));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float x;
    CK(cudaEventElapsedTime(&x, e0, e1));
    if (rep >= 2) ms.push_back(x);
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms[0]};
}

// Backward timing at GLM-5's indexer shape: row t selects min(t + 1, k) random keys of [0, t].
int bench(int s, int h_i, int k) {
  std::mt19937 g(7);
  std::normal_distribution<float> n;
  const int64_t t = s;
  std::vector<__nv_bfloat16> iq(t * h_i * 128), ik(t * 128);
  for (auto& x : iq) x = __float2bfloat16(n(g));
  for (auto& x : ik) x = __float2bfloat16(n(g));
  std::vector<float> w(t * h_i), ds(t * k, 0.f);
  for (auto& x : w) x = n(g) * 0.01f;
  std::vector<int> idx(t * k, -1);
  for (int64_t r = 0; r < t; ++r) {
    const int valid = int(std::min<int64_t>(r + 1, k));
    for (int j = 0; j < valid; ++j) {
      idx[r * k + j] = valid == r + 1 ? j : int(g() % uint32_t(r + 1));
      ds[r * k + j] = n(g) * 1e-3f;
    }
  }
  BwdArgs b{up(iq), up(ik), up(w), up(idx), up(ds), nullptr, nullptr, nullptr, t, h_i, k, s, s};
  CK(cudaMalloc(&b.d_iq, t * h_i * 128 * 4));
  CK(cudaMalloc(&b.d_ik, t * 128 * 4));
  CK(cudaMalloc(&b.d_w, t * h_i * 4));
  const auto ms = TimeBwd(b);
  const double flop = 3.0 * 2 * 32 * 128;  // per (row, slot), H_I padded to 32 or 64 not counted
  double pairs = 0;
  for (int64_t r = 0; r < t; ++r) pairs += std::min<int64_t>(r + 1, k);
  printf("bench S=%d h_i=%d k=%d bwd: median %.3f ms (min %.3f), %.0f TFLOP/s\n", s, h_i, k,
         ms.first, ms.second, flop * h_i / 32 * pairs / ms.first * 1e-9);
  return 0;
}

// The dense form's timing on the first key chunk of a causal row set: row t lists keys
// 0 .. min(t + 1, k) - 1 in order (the lists of neighbouring rows agree).
int bench_dense(int s, int h_i, int k) {
  std::mt19937 g(8);
  std::normal_distribution<float> n;
  std::uniform_real_distribution<float> u;
  const int64_t t = s;
  std::vector<__nv_bfloat16> iq(t * h_i * 128), ik(t * 128);
  for (auto& x : iq) x = __float2bfloat16(n(g));
  for (auto& x : ik) x = __float2bfloat16(n(g));
  std::vector<float> w(t * h_i), target(t * k), lse(t, 8.f);
  for (auto& x : w) x = n(g) * 0.01f;
  for (auto& x : target) x = u(g) * 1e-3f;
  std::vector<int> idx(t * k, -1);
  double pairs = 0;
  for (int64_t r = 0; r < t; ++r)
    for (int j = 0; j < std::min<int64_t>(r + 1, k); ++j, ++pairs) idx[r * k + j] = j;
  BwdArgs b{up(iq), up(ik), up(w), up(idx), nullptr, nullptr, nullptr, nullptr, t, h_i, k, s, s};
  b.index_lse = up(lse);
  b.target = up(target);
  CK(cudaMalloc(&b.d_iq, t * h_i * 128 * 4));
  CK(cudaMalloc(&b.d_ik, t * 128 * 4));
  CK(cudaMalloc(&b.d_w, t * h_i * 4));
  CK(cudaMalloc(&b.score, t * k * 4));
  const auto ms = TimeBwd(b);
  printf("bench dense S=%d h_i=%d k=%d: median %.3f ms (min %.3f), %.2f ns a pair\n", s, h_i, k,
         ms.first, ms.second, ms.first * 1e6 / pairs);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && strcmp(argv[1], "--bench") == 0) {
    const int s = argc > 2 ? atoi(argv[2]) : 16384;
    return bench(s, 32, 2048) | bench(s, 64, 2048) | bench_dense(s, 32, 2048);
  }
  if (argc > 1 && strcmp(argv[1], "--bench-dense") == 0)
    return bench_dense(argc > 2 ? atoi(argv[2]) : 16384, 32, 2048);
  int r = 0;
  r |= run(2, 37, 50, 80, 512, 5, 300, true, 1);
  r |= run(1, 9, 3000, 64, 576, 32, 2048, false, 2);
  r |= run(1, 11, 11, 16, 576, 64, 37, true, 3);
  r |= run(2, 70, 700, 64, 576, 32, 1000, false, 4);
  printf(r ? "harness FAILED\n" : "harness ok\n");
  return r;
}
