// Row kernels of the host sparse MLA (see rows.h). Built twice: JAX_DSA_ISA=Baseline and
// JAX_DSA_ISA=Avx2 (with -mavx2 -mfma); everything here but the entry point has internal linkage.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/numeric.h"
#include "cpu/sparse_mla/rows.h"

#ifndef JAX_DSA_ISA
#error "define JAX_DSA_ISA"
#endif
#define JAX_DSA_CAT2(a, b) a##b
#define JAX_DSA_CAT(a, b) JAX_DSA_CAT2(a, b)

namespace jax_dsa {
namespace {

// Valid slots of one query, in slot order (duplicates kept).
inline int64_t ValidRows(const int32_t* idx, int32_t length, int64_t k, int64_t s_kv,
                         int64_t* rows) {
  int64_t n = 0;
  const int64_t m = std::min<int64_t>(k, std::max<int32_t>(length, 0));
  for (int64_t j = 0; j < m; ++j) {
    int64_t r = idx[j];
    if (r >= 0 && r < s_kv) rows[n++] = r;
  }
  return n;
}

template <typename A>
inline A Dot(const A* a, const A* b, int64_t n) {
  // Eight partial sums so the loop vectorises without reassociation flags.
  A s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) s[u] += a[i + u] * b[i + u];
  for (; i < n; ++i) s[0] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

template <typename A>
inline void Axpy(A alpha, const A* __restrict x, A* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename A, typename T>
inline void LoadRow(const T* src, int64_t n, A* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = ToAcc<A, T>(src[i]);
}

template <typename A>
inline A LogAddExp(A a, A b) {
  if (a == -std::numeric_limits<A>::infinity()) return b;
  if (b == -std::numeric_limits<A>::infinity()) return a;
  if (a == std::numeric_limits<A>::infinity() || b == std::numeric_limits<A>::infinity())
    return std::numeric_limits<A>::infinity();  // a sink of +inf: no probability left
  A m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

template <typename A>
bool AllFinite(const A* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

template <typename A>
bool IsPosInf(A x) {
  return std::isinf(x) && x > 0;
}

template <typename T>
void Forward(const RowsShape& p, const FwdRows& a) {
  using A = typename Acc<T>::type;
  const int64_t h = p.h, d = p.d, s_kv = p.s_kv, k = p.k, d_v = p.d_v;
  const A scale = A(p.sm_scale);
  const T* q = static_cast<const T*>(a.q);
  const T* kv = static_cast<const T*>(a.kv);
  const A* sink = static_cast<const A*>(a.sink);
  T* out = static_cast<T*>(a.out);
  std::vector<int64_t> rows(k);
  std::vector<A> kr, qt(h * d), s, o(d_v);
  std::vector<char> q_ok(h);
  for (int64_t t = a.begin; t < a.end; ++t) {
    T* out_t = out + t * h * d_v;
    float* lse_t = a.lse + t * h;
    float* max_t = a.max_logits + t * h;
    const int64_t n = ValidRows(a.idx + t * k, a.len[t], k, s_kv, rows.data());
    if (n == 0) {
      for (int64_t i = 0; i < h * d_v; ++i) out_t[i] = FromAcc<T, A>(A(0));
      for (int64_t i = 0; i < h; ++i) lse_t[i] = std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < h; ++i) max_t[i] = -std::numeric_limits<float>::infinity();
      continue;
    }
    kr.resize(n * d);
    s.resize(h * n);
    for (int64_t j = 0; j < n; ++j) LoadRow(kv + rows[j] * d, d, kr.data() + j * d);
    LoadRow(q + t * h * d, h * d, qt.data());
    // A NaN or inf that the row reads (in its q or a selected row) makes the logit NaN, whatever
    // its sign: it reaches out and lse (the ops' convention for poisoned inputs).
    for (int64_t hh = 0; hh < h; ++hh) q_ok[hh] = AllFinite(qt.data() + hh * d, d);
    for (int64_t j = 0; j < n; ++j) {
      const bool row_ok = AllFinite(kr.data() + j * d, d);
      for (int64_t hh = 0; hh < h; ++hh)
        s[hh * n + j] = row_ok && q_ok[hh] ? scale * Dot(qt.data() + hh * d, kr.data() + j * d, d)
                                           : std::numeric_limits<A>::quiet_NaN();
    }
    for (int64_t hh = 0; hh < h; ++hh) {
      A* sh = s.data() + hh * n;
      A m = sh[0];  // a NaN maximum stays NaN (std::max_element would skip it)
      for (int64_t j = 1; j < n && !std::isnan(m); ++j) m = std::isnan(sh[j]) ? sh[j] : std::max(m, sh[j]);
      max_t[hh] = float(m);  // the scaled logits' maximum, before the sink (FlashMLA v2)
      if (!std::isfinite(m)) m = 0;  // keeps the exponentials defined for +-inf logits
      A l = 0;
      std::fill(o.begin(), o.end(), A(0));
      for (int64_t j = 0; j < n; ++j) {
        A e = std::exp(sh[j] - m);
        l += e;
        Axpy(e, kr.data() + j * d, o.data(), d_v);
      }
      const A denom = l + std::exp(sink[hh] - m);
      for (int64_t c = 0; c < d_v; ++c) out_t[hh * d_v + c] = FromAcc<T, A>(o[c] / denom);
      lse_t[hh] = float(m + std::log(l));
    }
  }
}

template <typename T>
void Backward(const RowsShape& p, const BwdRows& a) {
  using A = typename Acc<T>::type;
  const int64_t h = p.h, d = p.d, s_kv = p.s_kv, k = p.k, d_v = p.d_v;
  const A scale = A(p.sm_scale);
  const T* q = static_cast<const T*>(a.q);
  const T* kv = static_cast<const T*>(a.kv);
  const A* sink = static_cast<const A*>(a.sink);
  const T* out = static_cast<const T*>(a.out);
  const T* dout = static_cast<const T*>(a.dout);
  T* dq = static_cast<T*>(a.dq);
  A* acc = static_cast<A*>(a.dkv_acc);
  A* ds_sink = static_cast<A*>(a.dsink_acc);
  std::vector<int64_t> rows(k);
  std::vector<A> kr, qt(h * d), dot(h * d_v), ot(h * d_v), pm, dsm, dqh(d), dl(h), lf(h);
  for (int64_t t = a.begin; t < a.end; ++t) {
    T* dq_t = dq + t * h * d;
    const int64_t n = ValidRows(a.idx + t * k, a.len[t], k, s_kv, rows.data());
    if (n == 0) {
      for (int64_t i = 0; i < h * d; ++i) dq_t[i] = FromAcc<T, A>(A(0));
      continue;
    }
    kr.resize(n * d);
    pm.assign(h * n, A(0));
    dsm.assign(h * n, A(0));
    for (int64_t j = 0; j < n; ++j) LoadRow(kv + rows[j] * d, d, kr.data() + j * d);
    LoadRow(q + t * h * d, h * d, qt.data());
    LoadRow(dout + t * h * d_v, h * d_v, dot.data());
    LoadRow(out + t * h * d_v, h * d_v, ot.data());
    for (int64_t hh = 0; hh < h; ++hh) {
      const A lse_h = A(a.lse[t * h + hh]);
      dl[hh] = Dot(dot.data() + hh * d_v, ot.data() + hh * d_v, d_v);  // rowsum(dout * out)
      // +inf marks a row without a valid slot; a NaN lse (a poisoned row) passes NaN on.
      lf[hh] = std::isinf(lse_h) && lse_h > 0 ? std::numeric_limits<A>::infinity()
               : std::isnan(lse_h)            ? lse_h
                                              : LogAddExp(lse_h, sink[hh]);
    }
    // P and dS = P * (dout . v - delta), scaled for the q/k gradients.
    for (int64_t j = 0; j < n; ++j) {
      const A* kj = kr.data() + j * d;
      for (int64_t hh = 0; hh < h; ++hh) {
        if (IsPosInf(lf[hh])) continue;  // no valid slot: no gradient
        const A pj = std::exp(scale * Dot(qt.data() + hh * d, kj, d) - lf[hh]);
        pm[hh * n + j] = pj;
        dsm[hh * n + j] = scale * pj * (Dot(dot.data() + hh * d_v, kj, d_v) - dl[hh]);
      }
    }
    for (int64_t hh = 0; hh < h; ++hh) {
      std::fill(dqh.begin(), dqh.end(), A(0));
      for (int64_t j = 0; j < n; ++j) Axpy(dsm[hh * n + j], kr.data() + j * d, dqh.data(), d);
      for (int64_t c = 0; c < d; ++c) dq_t[hh * d + c] = FromAcc<T, A>(dqh[c]);
      if (!IsPosInf(lf[hh])) ds_sink[hh] -= std::exp(sink[hh] - lf[hh]) * dl[hh];
    }
    for (int64_t j = 0; j < n; ++j) {
      A* row = acc + rows[j] * d;
      for (int64_t hh = 0; hh < h; ++hh) {
        Axpy(dsm[hh * n + j], qt.data() + hh * d, row, d);
        Axpy(pm[hh * n + j], dot.data() + hh * d_v, row, d_v);
      }
    }
  }
}

void ForwardAny(Dtype t, const RowsShape& p, const FwdRows& a) {
  switch (t) {
    case Dtype::kF32: return Forward<float>(p, a);
    case Dtype::kF64: return Forward<double>(p, a);
    case Dtype::kBF16: return Forward<bf16_t>(p, a);
    case Dtype::kF16: return Forward<f16_t>(p, a);
  }
}

void BackwardAny(Dtype t, const RowsShape& p, const BwdRows& a) {
  switch (t) {
    case Dtype::kF32: return Backward<float>(p, a);
    case Dtype::kF64: return Backward<double>(p, a);
    case Dtype::kBF16: return Backward<bf16_t>(p, a);
    case Dtype::kF16: return Backward<f16_t>(p, a);
  }
}

}  // namespace

RowKernels JAX_DSA_CAT(RowKernels, JAX_DSA_ISA)() {
  return RowKernels{&ForwardAny, &BackwardAny, JAX_DSA_ISA_NAME};
}

}  // namespace jax_dsa
