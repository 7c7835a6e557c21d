// A standalone check of the indexer top-k launch code (ffi/cuda/indexer_topk) without XLA, small
// enough to run under compute-sanitizer (memcheck, racecheck): random bf16 inputs (with duplicated
// and zero key rows, so exact ties), several chunks, both head counts (32, 64), segment ids, rows
// longer than the shared-memory cache (the two-sweep top-k kernel). Each row is checked against a
// float64 reference of the scores: the right count, distinct visible keys, -1 padding, and no
// unselected visible key whose reference score beats a selected one's by more than the bf16-input
// error bound; the log-sum-exp mode against the same reference.
//
//   topk_selftest            # exit 0: every case passed
//   topk_selftest --bench [SHAPE]  # CUDA-event times of the kernels at GLM-5 shapes (no
//                                  # checks; SHAPE: only the shapes whose name contains it)
//
// Built by ffi/cuda/CMakeLists.txt with JAX_DSA_CUDA_SELFTEST=ON (not installed).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/indexer_topk/launch.h"

using jax_dsa::indexer::TopkLaunch;

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
                  cudaGetErrorString(e_));                                             \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

struct Case {
  const char* name;
  int nb, s_q, s_kv, h, topk, chunk_rows;
  int doc;       // > 0: segment ids = position / doc
  int ties;      // 1: duplicated and zero key rows; 2: nine key rows in ten zero (a plateau of
                 // equal scores at the threshold, more than the two-sweep kernel's candidates);
                 // 3: every row zero but s % 8 == 4, copies of one (with S_kv 8192, the two-sweep
                 // kernel's sampled keys are all high: its floor's fallback)
  bool pos_w;    // positive weights: scores far from zero against their spread
};

static float Bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

static int RunCase(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t nq = int64_t(c.nb) * c.s_q, nk = int64_t(c.nb) * c.s_kv;
  std::vector<float> qf(nq * c.h * 128), kf(nk * 128), w(nq * c.h);
  for (auto& x : qf) x = Bf(nd(rng) * 0.5f);
  for (auto& x : kf) x = Bf(nd(rng));
  for (auto& x : w) x = c.pos_w ? std::fabs(nd(rng)) * 0.1f + 0.05f : nd(rng) * 0.1f;
  if (c.ties == 1) {
    for (int64_t s = 0; s < nk; ++s) {
      if (s % 5 == 1) std::copy(&kf[(s - 1) * 128], &kf[s * 128], &kf[s * 128]);  // duplicate
      if (s % 7 == 3) std::fill(&kf[s * 128], &kf[(s + 1) * 128], 0.f);           // zero row
    }
  } else if (c.ties == 2) {
    for (int64_t s = 0; s < nk; ++s)
      if (s % 10 != 0) std::fill(&kf[s * 128], &kf[(s + 1) * 128], 0.f);
  } else if (c.ties == 3) {
    for (int64_t s = 0; s < nk; ++s) {
      if (s % 8 != 4) std::fill(&kf[s * 128], &kf[(s + 1) * 128], 0.f);
      else std::copy(&kf[4 * 128], &kf[5 * 128], &kf[s * 128]);
    }
  }
  std::vector<int32_t> qp(nq), kp(nk), qs(nq), ks(nk);
  for (int b = 0; b < c.nb; ++b) {
    for (int t = 0; t < c.s_q; ++t) {
      const int p = t + (c.s_kv - c.s_q);
      qp[b * c.s_q + t] = p;
      qs[b * c.s_q + t] = c.doc > 0 ? p / c.doc : 0;
    }
    for (int s = 0; s < c.s_kv; ++s) {
      kp[b * c.s_kv + s] = s;
      ks[b * c.s_kv + s] = c.doc > 0 ? s / c.doc : 0;
    }
  }
  std::vector<__nv_bfloat16> qb(qf.size()), kb(kf.size());
  for (size_t i = 0; i < qf.size(); ++i) qb[i] = __float2bfloat16(qf[i]);
  for (size_t i = 0; i < kf.size(); ++i) kb[i] = __float2bfloat16(kf[i]);

  void *dq, *dk, *dw, *dqp, *dkp, *dqs, *dks, *dout, *dws;
  const size_t ws = jax_dsa::indexer::TopkWorkspaceBytes(c.s_kv, c.chunk_rows);
  CHECK_CUDA(cudaMalloc(&dq, qb.size() * 2));
  CHECK_CUDA(cudaMalloc(&dk, kb.size() * 2));
  CHECK_CUDA(cudaMalloc(&dw, w.size() * 4));
  CHECK_CUDA(cudaMalloc(&dqp, nq * 4));
  CHECK_CUDA(cudaMalloc(&dkp, nk * 4));
  CHECK_CUDA(cudaMalloc(&dqs, nq * 4));
  CHECK_CUDA(cudaMalloc(&dks, nk * 4));
  CHECK_CUDA(cudaMalloc(&dout, nq * c.topk * 4));
  CHECK_CUDA(cudaMalloc(&dws, ws));
  CHECK_CUDA(cudaMemcpy(dq, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dqp, qp.data(), nq * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkp, kp.data(), nk * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dqs, qs.data(), nq * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dks, ks.data(), nk * 4, cudaMemcpyHostToDevice));

  std::vector<int32_t> out(nq * c.topk);
  {
    TopkLaunch a{dq, dk, static_cast<float*>(dw), static_cast<int32_t*>(dqp), static_cast<int32_t*>(dkp),
                 static_cast<int32_t*>(dqs), static_cast<int32_t*>(dks), static_cast<int32_t*>(dout), dws,
                 c.nb, c.s_q, c.s_kv, c.h, c.topk, c.chunk_rows, nullptr};
    CHECK_CUDA(cudaMemset(dout, 0x7f, nq * c.topk * 4));  // poison
    CHECK_CUDA(cudaMemset(dws, 0xff, ws));                // NaN scores where unwritten
    const char* what = "";
    cudaError_t e = jax_dsa::indexer::LaunchTopk(a, &what);
    if (e != cudaSuccess) {
      std::printf("%s: launch failed (%s): %s\n", c.name, what, cudaGetErrorString(e));
      return 1;
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost));
  }

  // The score kernel's log-sum-exp mode (LaunchIndexLse), checked in the row loop.
  std::vector<float> lse_v(nq);
  {
    const size_t lws = jax_dsa::indexer::IndexLseWorkspaceBytes(c.s_kv, c.s_q);
    void *dlws, *dlse;
    CHECK_CUDA(cudaMalloc(&dlws, lws));
    CHECK_CUDA(cudaMalloc(&dlse, nq * 4));
    CHECK_CUDA(cudaMemset(dlws, 0xff, lws));
    CHECK_CUDA(cudaMemset(dlse, 0xff, nq * 4));  // poison: NaN
    TopkLaunch a{dq, dk, static_cast<float*>(dw), static_cast<int32_t*>(dqp), static_cast<int32_t*>(dkp),
                 static_cast<int32_t*>(dqs), static_cast<int32_t*>(dks), nullptr, dlws,
                 c.nb, c.s_q, c.s_kv, c.h, 1, c.s_q, nullptr};
    const char* what = "";
    cudaError_t e = jax_dsa::indexer::LaunchIndexLse(a, static_cast<float*>(dlse), &what);
    if (e != cudaSuccess) {
      std::printf("%s: lse launch failed (%s): %s\n", c.name, what, cudaGetErrorString(e));
      return 1;
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(lse_v.data(), dlse, nq * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(dlws));
    CHECK_CUDA(cudaFree(dlse));
  }
  int bad_lse = 0;
  int bad_rows = 0;
  long long ties_checked = 0;
  {
    std::vector<double> ref(c.s_kv), bound(c.s_kv);
    std::vector<char> vis(c.s_kv), chosen(c.s_kv);
    for (int b = 0; b < c.nb; ++b) {
      for (int t = 0; t < c.s_q; ++t) {
        const int64_t row = int64_t(b) * c.s_q + t;
        int visible = 0;
        for (int s = 0; s < c.s_kv; ++s) {
          const int64_t ks_ = int64_t(b) * c.s_kv + s;
          vis[s] = kp[ks_] <= qp[row] && ks[ks_] == qs[row];
          visible += vis[s];
          double acc = 0, absacc = 0;
          for (int hh = 0; hh < c.h; ++hh) {
            double dot = 0, adot = 0;
            for (int d = 0; d < 128; ++d) {
              const double x = qf[(row * c.h + hh) * 128 + d], y = kf[ks_ * 128 + d];
              dot += x * y;
              adot += std::fabs(x * y);
            }
            acc += w[row * c.h + hh] * std::max(dot, 0.0);
            absacc += std::fabs(w[row * c.h + hh]) * adot;
          }
          ref[s] = acc;
          bound[s] = absacc * 4e-5 + 1e-30;  // (128 * 2^-22 + 64 * 2^-23) * sum |w||q||k|
        }
        {  // |lse - ref| within the largest visible score's bound
          double mx = -INFINITY, se = 0, bmax = 0;
          for (int s = 0; s < c.s_kv; ++s)
            if (vis[s]) mx = std::max(mx, ref[s]), bmax = std::max(bmax, bound[s]);
          for (int s = 0; s < c.s_kv; ++s)
            if (vis[s]) se += std::exp(ref[s] - mx);
          const float got = lse_v[row];
          const bool ok_l = visible == 0 ? got == -INFINITY
                                         : std::fabs(got - (mx + std::log(se))) <=
                                               bmax + 1e-5 * std::fabs(mx) + 1e-6;
          if (!ok_l && bad_lse++ < 3)
            std::printf("%s: row %lld lse %.7g, float64 %.7g\n", c.name, (long long)row, got,
                        visible ? mx + std::log(se) : -INFINITY);
        }
        const int kprime = std::min(visible, c.topk);
        std::fill(chosen.begin(), chosen.end(), 0);
        bool ok = true;
        double min_sel = INFINITY, min_sel_b = 0;
        for (int i = 0; i < c.topk; ++i) {
          const int32_t v = out[row * c.topk + i];
          if (i < kprime) {
            if (v < 0 || v >= c.s_kv || !vis[v] || chosen[v]) { ok = false; break; }
            chosen[v] = 1;
            if (ref[v] < min_sel) { min_sel = ref[v]; min_sel_b = bound[v]; }
          } else if (v != -1) {
            ok = false;
            break;
          }
        }
        if (ok) {
          for (int s = 0; s < c.s_kv; ++s) {
            if (vis[s] && !chosen[s] && ref[s] > min_sel + min_sel_b + bound[s]) { ok = false; break; }
            if (vis[s] && !chosen[s] && ref[s] == min_sel) ++ties_checked;
          }
        }
        if (!ok && bad_rows++ < 3) {
          std::printf("%s: row %lld wrong (visible %d, kprime %d): first slots", c.name, (long long)row,
                      visible, kprime);
          for (int i = 0; i < std::min(c.topk, 8); ++i) std::printf(" %d", out[row * c.topk + i]);
          std::printf("\n");
        }
      }
    }
  }
  for (void* p : {dq, dk, dw, dqp, dkp, dqs, dks, dout, dws}) CHECK_CUDA(cudaFree(p));
  const bool bad = bad_rows || bad_lse;
  std::printf("%s: %s (%d of %lld rows wrong; %lld exact ties at the threshold left out; %d lse "
              "rows wrong)\n", c.name, bad ? "FAIL" : "ok", bad_rows, (long long)nq, ties_checked,
              bad_lse);
  return bad ? 1 : 0;
}

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}
// ~N(0, scale^2): a sum of four uniforms.
__device__ float Gauss(uint64_t i, uint64_t seed, float scale) {
  float s = 0.f;
  for (int r = 0; r < 4; ++r) s += Hash(i * 4 + r + seed) * (1.f / 4294967296.f);
  return (s - 2.f) * 1.7320508f * scale;
}
__global__ void FillBf16(__nv_bfloat16* x, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(Gauss(i, seed, scale));
}
__global__ void FillF32(float* x, int64_t n, uint64_t seed, float scale, bool positive) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = positive ? fabsf(Gauss(i, seed, scale)) : Gauss(i, seed, scale);
}
__global__ void FillIota(int32_t* x, int64_t n, int32_t off) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = int32_t(i) + off;
}

static float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CUDA-event times (median of reps) of the whole launch, the score kernel alone and the top-k kernel
// alone (on the last chunk's scores, so with several chunks it times the longest rows' chunk that
// many times), at GLM-5 shapes.
static int Bench(const char* only) {
  struct Shape {
    const char* name;
    int h, s_q, s_kv, off;
    bool pos_w;  // positive weights: every score > 0, crowded top bits
  };
  const Shape shapes[] = {{"glm5 4k causal", 32, 4096, 4096, 0, false},
                          {"glm5 16k causal", 32, 16384, 16384, 0, false},
                          {"glm5 32k causal", 32, 32768, 32768, 0, false},
                          {"glm5 128k kv, last 4096 q", 32, 4096, 131072, 131072 - 4096, false},
                          {"v3.2 16k causal (h64)", 64, 16384, 16384, 0, false},
                          {"glm5 16k causal, w > 0", 32, 16384, 16384, 0, true}};
  const int topk = 2048, reps = 10;
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::printf("%-28s %9s %9s %9s   TFLOP/s (score)\n", "shape (ms, CUDA events)", "whole", "top-k",
              "score");
  for (const Shape& sh : shapes) {
    if (only && !std::strstr(sh.name, only)) continue;
    const int64_t ld = int64_t(jax_dsa::indexer::TopkRowStride(sh.s_kv));
    int64_t rows = std::max<int64_t>(8, ((int64_t(1) << 30) / (ld * 4)) / 8 * 8);
    rows = std::min<int64_t>(rows, (sh.s_q + 7) / 8 * 8);
    const size_t ws = jax_dsa::indexer::TopkWorkspaceBytes(sh.s_kv, rows);
    void *dq, *dk, *dw, *dqp, *dkp, *dseg, *dout, *dws;
    CHECK_CUDA(cudaMalloc(&dq, int64_t(sh.s_q) * sh.h * 128 * 2));
    CHECK_CUDA(cudaMalloc(&dk, int64_t(sh.s_kv) * 128 * 2));
    CHECK_CUDA(cudaMalloc(&dw, int64_t(sh.s_q) * sh.h * 4));
    CHECK_CUDA(cudaMalloc(&dqp, int64_t(sh.s_q) * 4));
    CHECK_CUDA(cudaMalloc(&dkp, int64_t(sh.s_kv) * 4));
    CHECK_CUDA(cudaMalloc(&dseg, int64_t(std::max(sh.s_q, sh.s_kv)) * 4));
    CHECK_CUDA(cudaMalloc(&dout, int64_t(sh.s_q) * topk * 4));
    CHECK_CUDA(cudaMalloc(&dws, ws));
    FillBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(dq), int64_t(sh.s_q) * sh.h * 128, 1, 0.5f);
    FillBf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(dk), int64_t(sh.s_kv) * 128, 777777777, 1.f);
    FillF32<<<1024, 256>>>(static_cast<float*>(dw), int64_t(sh.s_q) * sh.h, 555555555,
                           1.f / std::sqrt(float(sh.h) * 128.f), sh.pos_w);
    FillIota<<<256, 256>>>(static_cast<int32_t*>(dqp), sh.s_q, sh.off);
    FillIota<<<256, 256>>>(static_cast<int32_t*>(dkp), sh.s_kv, 0);
    CHECK_CUDA(cudaMemset(dseg, 0, int64_t(std::max(sh.s_q, sh.s_kv)) * 4));
    CHECK_CUDA(cudaGetLastError());
    TopkLaunch a{dq, dk, static_cast<float*>(dw), static_cast<int32_t*>(dqp), static_cast<int32_t*>(dkp),
                 static_cast<int32_t*>(dseg), static_cast<int32_t*>(dseg), static_cast<int32_t*>(dout), dws,
                 1, sh.s_q, sh.s_kv, sh.h, topk, rows, nullptr};
    auto time = [&](int stages) {
      a.stages = stages;
      std::vector<float> t;
      for (int r = 0; r < reps + 2; ++r) {
        const char* what = "";
        CHECK_CUDA(cudaEventRecord(e0));
        CHECK_CUDA(jax_dsa::indexer::LaunchTopk(a, &what));
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) t.push_back(ms);
      }
      return Median(t);
    };
    const float full = time(0);
    const float topk_only = time(2);
    const float score_only = time(1);

    double visible = 0;
    for (int t = 0; t < sh.s_q; ++t) visible += std::min<int64_t>(int64_t(t) + sh.off + 1, sh.s_kv);
    const double flops = 2.0 * sh.h * 128 * visible;
    std::printf("%-28s %9.3f %9.3f %9.3f   %6.1f (whole %6.1f)\n", sh.name, full, topk_only, score_only,
                flops / (score_only * 1e-3) / 1e12, flops / (full * 1e-3) / 1e12);
    {  // the log-sum-exp mode (the dense KL loss's normaliser)
      void *dlws, *dlse;
      CHECK_CUDA(cudaMalloc(&dlws, jax_dsa::indexer::IndexLseWorkspaceBytes(sh.s_kv, sh.s_q)));
      CHECK_CUDA(cudaMalloc(&dlse, int64_t(sh.s_q) * 4));
      TopkLaunch b = a;
      b.workspace = dlws;
      std::vector<float> t;
      for (int r = 0; r < reps + 2; ++r) {
        const char* what = "";
        CHECK_CUDA(cudaEventRecord(e0));
        CHECK_CUDA(jax_dsa::indexer::LaunchIndexLse(b, static_cast<float*>(dlse), &what));
        CHECK_CUDA(cudaEventRecord(e1));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) t.push_back(ms);
      }
      const float ms = Median(t);
      std::printf("%-28s index lse %9.3f ms, %6.1f TFLOP/s\n", sh.name, ms, flops / (ms * 1e-3) / 1e12);
      CHECK_CUDA(cudaFree(dlws));
      CHECK_CUDA(cudaFree(dlse));
    }
    for (void* p : {dq, dk, dw, dqp, dkp, dseg, dout, dws}) CHECK_CUDA(cudaFree(p));
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--bench") return Bench(argc > 2 ? argv[2] : nullptr);
  std::mt19937 rng(1234);
  const Case cases[] = {
      {"h32 causal, 2 batch, chunks of 16", 2, 77, 333, 32, 64, 16, 0, 0, false},
      {"h64 docs of 37, topk > S_kv", 1, 50, 200, 64, 512, 24, 37, 0, false},
      {"h32 long rows (no smem cache)", 1, 8, 50000, 32, 100, 8, 0, 0, false},
      {"h32 exact ties (duplicate and zero keys)", 1, 40, 256, 32, 48, 40, 0, 1, false},
      {"h64 exact ties, topk 2048", 1, 16, 2500, 64, 2048, 8, 0, 1, false},
      {"h32 long rows, topk 2048, positive weights", 1, 8, 20000, 32, 2048, 8, 0, 0, true},
      {"h32 long rows, a plateau of zero scores, topk 2048", 1, 8, 30000, 32, 2048, 8, 0, 2, false},
      {"h32 sampled keys above the rest, topk 2048", 1, 8, 8192, 32, 2048, 8, 0, 3, true},
  };
  int fails = 0;
  for (const Case& c : cases) fails += RunCase(c, rng);
  std::printf(fails ? "SELFTEST FAILED\n" : "SELFTEST PASSED\n");
  return fails ? 1 : 0;
}
