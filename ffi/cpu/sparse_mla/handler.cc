// Host sparse MLA forward and backward as XLA FFI handlers (the "cpu" implementation of
// jax_dsa/ops/sparse_mla/cpu.py; the module ffi/cpu/module_cpu.cc registers them).
//
// Same contract as jax_dsa.ops.sparse_mla (see its docstring): one latent kv row per token,
// K = kv[:, :D_qk], V = kv[:, :d_v]; a slot j of query t is valid when 0 <= indices[t, j] < S_kv
// and j < topk_length[t]; invalid slots are never read; a row with no valid slot gives out 0,
// lse +inf, max_logits -inf and no gradient; the sink adds exp(attn_sink[h]) to the softmax
// denominator only (not to lse or max_logits).
// Math: FlashMLA's sparse prefill forward (deepseek-ai/FlashMLA tests/ref.py) and the
// FlashAttention-2 backward (Dao 2023, arXiv:2307.08691, Alg. 2) over the selected rows.
//
// Buffers may carry extra leading dims (the op's batch and vmap's `expand_dims` axes); inputs
// broadcast over leading dims of size 1, left-aligned (attn_sink has no batch dim of its own).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/numeric.h"
#include "cpu/sparse_mla/handler.h"
#include "cpu/sparse_mla/rows.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

// ---------------------------------------------------------------------------------------------
// Parallel loop on XLA's intra-op thread pool. The calling thread takes chunks too and waits only
// for chunks that were claimed, so a helper that never gets scheduled cannot deadlock the call.
struct LoopState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> slots{1};
  std::mutex mu;
  std::condition_variable cv;
};

// f(worker_slot, begin, end); worker_slot < max_workers.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t grain, int max_workers, F& f) {
  if (n <= 0) return;
  const int64_t nchunks = (n + grain - 1) / grain;
  const int workers = int(std::min<int64_t>(max_workers, nchunks));
  if (workers <= 1) {
    f(0, 0, n);
    return;
  }
  auto st = std::make_shared<LoopState>();
  F* fp = &f;
  auto work = [st, fp, nchunks, grain, n](int slot) {
    for (int64_t c; (c = st->next.fetch_add(1)) < nchunks;) {
      (*fp)(slot, c * grain, std::min(n, (c + 1) * grain));
      if (st->done.fetch_add(1) + 1 == nchunks) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  for (int i = 1; i < workers; ++i) {
    pool.Schedule([st, work, workers]() {
      int slot = st->slots.fetch_add(1);
      if (slot < workers) work(slot);
    });
  }
  work(0);
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == nchunks; });
}

int MaxWorkers(ffi::ThreadPool& pool) {
  return int(std::max<int64_t>(1, pool.num_threads() + 1));
}

// ---------------------------------------------------------------------------------------------
// Shapes and leading-dim broadcasting.
std::string DimsStr(ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

struct Lead {
  std::vector<int64_t> dims;  // leading dims of the call (from the primary output)
  int64_t count = 1;
};

// Maps a flat leading index of the call to a flat batch index of one argument.
struct BatchMap {
  std::vector<int64_t> strides;  // per call leading dim; 0 where the argument broadcasts
  int64_t operator()(const Lead& lead, int64_t b) const {
    int64_t idx = 0;
    for (int i = int(lead.dims.size()) - 1; i >= 0; --i) {
      idx += (b % lead.dims[i]) * strides[i];
      b /= lead.dims[i];
    }
    return idx;
  }
};

// Checks `dims` = lead' + core (lead' left-aligned against lead, each 1 or equal; exactly as
// many leading dims as the call unless `fewer_ok`) and builds its batch map.
ffi::Error MapArg(const char* name, ffi::Span<const int64_t> dims, size_t core_rank,
                  const Lead& lead, bool fewer_ok, bool broadcast_ok, BatchMap* map) {
  const char* op = "jax_dsa sparse_mla (cpu): ";
  if (dims.size() < core_rank) {
    return ffi::Error::InvalidArgument(std::string(op) + name + " has rank " +
                                       std::to_string(dims.size()) + ", needs at least " +
                                       std::to_string(core_rank));
  }
  size_t nl = dims.size() - core_rank;
  if (nl > lead.dims.size() || (!fewer_ok && nl != lead.dims.size())) {
    return ffi::Error::InvalidArgument(std::string(op) + name + " " + DimsStr(dims) +
                                       " has leading dims that do not match the call's " +
                                       DimsStr(lead.dims));
  }
  map->strides.assign(lead.dims.size(), 0);
  int64_t stride = 1;
  for (int i = int(nl) - 1; i >= 0; --i) {
    if (dims[i] == lead.dims[i]) {
      map->strides[i] = lead.dims[i] == 1 ? 0 : stride;
    } else if (dims[i] != 1 || !broadcast_ok) {
      return ffi::Error::InvalidArgument(std::string(op) + name + " " + DimsStr(dims) +
                                         ": leading dim " + std::to_string(i) +
                                         " must be 1 or " + std::to_string(lead.dims[i]));
    }
    stride *= dims[i];
  }
  return ffi::Error::Success();
}

ffi::Error CheckCore(const char* name, ffi::Span<const int64_t> dims,
                     std::initializer_list<int64_t> want) {
  size_t r = want.size();
  size_t i = dims.size() - r;
  for (int64_t w : want) {
    if (dims[i] != w) {
      std::string s = "(";
      bool first = true;
      for (int64_t x : want) { s += (first ? "" : ", ") + std::to_string(x); first = false; }
      return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): " + std::string(name) + " " +
                                         DimsStr(dims) + " must end in " + s + ")");
    }
    ++i;
  }
  return ffi::Error::Success();
}

#define JAX_DSA_RETURN_IF_ERROR(expr)        \
  do {                                       \
    ffi::Error _e = (expr);                  \
    if (_e.failure()) return _e;             \
  } while (0)

struct Problem {
  Lead lead;
  int64_t s_q, h, d, s_kv, k, d_v;
  BatchMap q, kv, idx, len, sink;
};

// Common checks for the inputs both directions share.
ffi::Error SetUp(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::Buffer<ffi::S32> indices,
                 ffi::AnyBuffer sink, ffi::Buffer<ffi::S32> lengths,
                 ffi::Span<const int64_t> primary_dims, int64_t d_v, Problem* p) {
  auto qd = q.dimensions();
  if (qd.size() < 3) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): q must be [..., S_q, H, D_qk], got " +
                                       DimsStr(qd));
  }
  p->s_q = qd[qd.size() - 3];
  p->h = qd[qd.size() - 2];
  p->d = qd[qd.size() - 1];
  auto kd = kv.dimensions();
  if (kd.size() < 2) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): kv must be [..., S_kv, D_qk], got " +
                                       DimsStr(kd));
  }
  p->s_kv = kd[kd.size() - 2];
  auto id = indices.dimensions();
  if (id.size() < 2) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): indices must be [..., S_q, K], got " +
                                       DimsStr(id));
  }
  p->k = id[id.size() - 1];
  p->d_v = d_v;
  if (d_v <= 0 || d_v > p->d) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): attribute d_v=" +
                                       std::to_string(d_v) + " must be in [1, D_qk=" +
                                       std::to_string(p->d) + "]");
  }
  if (kv.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): kv's dtype differs from q's");
  }
  JAX_DSA_RETURN_IF_ERROR(CheckCore("kv", kd, {p->s_kv, p->d}));
  JAX_DSA_RETURN_IF_ERROR(CheckCore("indices", id, {p->s_q, p->k}));
  auto ld = lengths.dimensions();
  if (ld.size() < 1) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): topk_length must be [..., S_q]");
  }
  JAX_DSA_RETURN_IF_ERROR(CheckCore("topk_length", ld, {p->s_q}));
  auto sd = sink.dimensions();
  if (sd.size() < 1) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): attn_sink must be [..., H]");
  }
  JAX_DSA_RETURN_IF_ERROR(CheckCore("attn_sink", sd, {p->h}));

  p->lead.dims.assign(primary_dims.begin(), primary_dims.end() - 3);
  p->lead.count = 1;
  for (int64_t x : p->lead.dims) p->lead.count *= x;
  JAX_DSA_RETURN_IF_ERROR(MapArg("q", qd, 3, p->lead, false, true, &p->q));
  JAX_DSA_RETURN_IF_ERROR(MapArg("kv", kd, 2, p->lead, false, true, &p->kv));
  JAX_DSA_RETURN_IF_ERROR(MapArg("indices", id, 2, p->lead, false, true, &p->idx));
  JAX_DSA_RETURN_IF_ERROR(MapArg("topk_length", ld, 1, p->lead, false, true, &p->len));
  JAX_DSA_RETURN_IF_ERROR(MapArg("attn_sink", sd, 1, p->lead, true, true, &p->sink));
  return ffi::Error::Success();
}

// Row kernels for this CPU: AVX2+FMA when it has them, else baseline x86-64 (CPUID, once).
const RowKernels& NativeKernels() {
  static const RowKernels k = [] {
#if defined(__x86_64__) && defined(JAX_DSA_HAVE_AVX2)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return RowKernelsAvx2();
#endif
    return RowKernelsBaseline();
  }();
  return k;
}

const RowKernels& BaselineKernels() {
  static const RowKernels k = RowKernelsBaseline();
  return k;
}

// What the handlers use: NativeKernels() unless UseKernelIsa("baseline") chose the baseline.
std::atomic<const RowKernels*> g_kernels{nullptr};

const RowKernels& Kernels() {
  const RowKernels* k = g_kernels.load(std::memory_order_acquire);
  return k ? *k : NativeKernels();
}

template <typename T> constexpr Dtype DtypeOf();
template <> constexpr Dtype DtypeOf<float>() { return Dtype::kF32; }
template <> constexpr Dtype DtypeOf<double>() { return Dtype::kF64; }
template <> constexpr Dtype DtypeOf<bf16_t>() { return Dtype::kBF16; }
template <> constexpr Dtype DtypeOf<f16_t>() { return Dtype::kF16; }

RowsShape Shape(const Problem& p, double sm_scale) {
  return RowsShape{p.s_q, p.h, p.d, p.s_kv, p.k, p.d_v, sm_scale};
}

// ---------------------------------------------------------------------------------------------
// Forward.
template <typename T>
ffi::Error Forward(ffi::ThreadPool& pool, const Problem& p, const T* q, const T* kv,
                   const int32_t* indices, const typename Acc<T>::type* sink,
                   const int32_t* lengths, T* out, float* lse, float* max_logits,
                   double sm_scale) {
  const int64_t s_q = p.s_q, h = p.h, d = p.d, s_kv = p.s_kv, k = p.k, d_v = p.d_v;
  const int64_t rows_total = p.lead.count * s_q;
  const int workers = MaxWorkers(pool);

  const RowsShape shape = Shape(p, sm_scale);
  const RowKernels& kern = Kernels();
  auto body = [&](int /*slot*/, int64_t begin, int64_t end) {
    // Split the flat row range at batch-element boundaries.
    for (int64_t r = begin; r < end;) {
      const int64_t b = r / s_q, t0 = r % s_q, t1 = std::min(s_q, t0 + (end - r));
      FwdRows rows{q + p.q(p.lead, b) * s_q * h * d, kv + p.kv(p.lead, b) * s_kv * d,
                   indices + p.idx(p.lead, b) * s_q * k, lengths + p.len(p.lead, b) * s_q,
                   sink + p.sink(p.lead, b) * h, out + b * s_q * h * d_v, lse + b * s_q * h,
                   max_logits + b * s_q * h, t0, t1};
      kern.forward(DtypeOf<T>(), shape, rows);
      r += t1 - t0;
    }
  };
  ParallelFor(pool, rows_total, 4, workers, body);
  return ffi::Error::Success();
}

ffi::Error CheckOutput(const char* name, ffi::Span<const int64_t> got,
                       const std::vector<int64_t>& want) {
  if (got.size() != want.size() || !std::equal(want.begin(), want.end(), got.begin())) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): result " + std::string(name) +
                                       " has shape " + DimsStr(got) + ", expected " +
                                       DimsStr(ffi::Span<const int64_t>(want.data(), want.size())));
  }
  return ffi::Error::Success();
}

std::vector<int64_t> Concat(const std::vector<int64_t>& a, std::initializer_list<int64_t> b) {
  std::vector<int64_t> r = a;
  r.insert(r.end(), b.begin(), b.end());
  return r;
}

ffi::Error CheckFloatTypes(ffi::DataType t, ffi::DataType sink_t, const char* sink_name) {
  if (t != ffi::DataType::BF16 && t != ffi::DataType::F16 && t != ffi::DataType::F32 &&
      t != ffi::DataType::F64) {
    return ffi::Error::InvalidArgument(
        "jax_dsa sparse_mla (cpu): q must be bfloat16, float16, float32 or float64");
  }
  ffi::DataType want = t == ffi::DataType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
  if (sink_t != want) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): " + std::string(sink_name) +
                                       " must be float32 (float64 for float64 q)");
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                       ffi::Buffer<ffi::S32> indices, ffi::AnyBuffer sink,
                       ffi::Buffer<ffi::S32> lengths, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::Buffer<ffi::F32>> lse,
                       ffi::Result<ffi::Buffer<ffi::F32>> max_logits, double sm_scale,
                       int64_t d_v) {
  JAX_DSA_RETURN_IF_ERROR(CheckFloatTypes(q.element_type(), sink.element_type(), "attn_sink"));
  Problem p;
  auto od = out->dimensions();
  if (od.size() < 3) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): result out must be [..., S_q, H, d_v]");
  }
  JAX_DSA_RETURN_IF_ERROR(SetUp(q, kv, indices, sink, lengths, od, d_v, &p));
  JAX_DSA_RETURN_IF_ERROR(CheckOutput("out", od, Concat(p.lead.dims, {p.s_q, p.h, p.d_v})));
  JAX_DSA_RETURN_IF_ERROR(CheckOutput("lse", lse->dimensions(), Concat(p.lead.dims, {p.s_q, p.h})));
  JAX_DSA_RETURN_IF_ERROR(CheckOutput("max_logits", max_logits->dimensions(),
                                      Concat(p.lead.dims, {p.s_q, p.h})));
  if (out->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): result out must have q's dtype");
  }
  const int32_t* idx = indices.typed_data();
  const int32_t* len = lengths.typed_data();
  float* l = lse->typed_data();
  float* mx = max_logits->typed_data();
  switch (q.element_type()) {
    case ffi::DataType::F32:
      return Forward<float>(pool, p, q.typed_data<float>(), kv.typed_data<float>(), idx,
                            sink.typed_data<float>(), len, out->typed_data<float>(), l, mx,
                            sm_scale);
    case ffi::DataType::F64:
      return Forward<double>(pool, p, q.typed_data<double>(), kv.typed_data<double>(), idx,
                             sink.typed_data<double>(), len, out->typed_data<double>(), l,
                             mx, sm_scale);
    case ffi::DataType::BF16:
      return Forward<bf16_t>(pool, p, static_cast<const bf16_t*>(q.untyped_data()),
                             static_cast<const bf16_t*>(kv.untyped_data()), idx,
                             sink.typed_data<float>(), len,
                             static_cast<bf16_t*>(out->untyped_data()), l, mx, sm_scale);
    case ffi::DataType::F16:
      return Forward<f16_t>(pool, p, static_cast<const f16_t*>(q.untyped_data()),
                            static_cast<const f16_t*>(kv.untyped_data()), idx,
                            sink.typed_data<float>(), len,
                            static_cast<f16_t*>(out->untyped_data()), l, mx, sm_scale);
    default:
      return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): unsupported q dtype");
  }
}

// ---------------------------------------------------------------------------------------------
// Backward. dkv is accumulated per task (slots of different queries may name the same row) and
// reduced once per batch element in task order; d_attn_sink likewise.
template <typename T>
ffi::Error Backward(ffi::ThreadPool& pool, const Problem& p, const T* q, const T* kv,
                    const int32_t* indices, const typename Acc<T>::type* sink,
                    const int32_t* lengths, const T* out, const float* lse, const T* dout,
                    const BatchMap& out_map, const BatchMap& lse_map, const BatchMap& dout_map,
                    T* dq, T* dkv, typename Acc<T>::type* dsink, const Lead& dsink_lead,
                    double sm_scale) {
  using A = typename Acc<T>::type;
  const int64_t s_q = p.s_q, h = p.h, d = p.d, s_kv = p.s_kv, k = p.k, d_v = p.d_v;
  const RowsShape shape = Shape(p, sm_scale);
  const RowKernels& kern = Kernels();
  const int max_workers = int(std::min<int64_t>(MaxWorkers(pool), std::max<int64_t>(1, s_q / 8)));

  std::vector<std::vector<A>> dkv_acc(max_workers);
  std::vector<std::vector<A>> dsink_acc(max_workers, std::vector<A>(h, A(0)));
  std::vector<char> used(max_workers, 0);
  // d_attn_sink sums over the leading dims it does not have.
  std::vector<A> dsink_total(dsink_lead.count * h, A(0));
  const int64_t dsink_div = p.lead.count / dsink_lead.count;

  for (int64_t b = 0; b < p.lead.count; ++b) {
    const T* q_b = q + p.q(p.lead, b) * s_q * h * d;
    const T* kv_b = kv + p.kv(p.lead, b) * s_kv * d;
    const int32_t* idx_b = indices + p.idx(p.lead, b) * s_q * k;
    const int32_t* len_b = lengths + p.len(p.lead, b) * s_q;
    const A* sink_b = sink + p.sink(p.lead, b) * h;
    const T* out_b = out + out_map(p.lead, b) * s_q * h * d_v;
    const float* lse_b = lse + lse_map(p.lead, b) * s_q * h;
    const T* dout_b = dout + dout_map(p.lead, b) * s_q * h * d_v;
    T* dq_b = dq + b * s_q * h * d;
    std::fill(used.begin(), used.end(), 0);

    // Each task owns a fixed range of queries and its own accumulators, reduced in task order:
    // the result does not depend on which thread ran which task (deterministic gradients).
    const int64_t chunk = (s_q + max_workers - 1) / max_workers;
    auto body = [&](int, int64_t task_begin, int64_t task_end) {
      for (int64_t t = task_begin; t < task_end; ++t) {
        const int64_t begin = t * chunk, end = std::min(s_q, begin + chunk);
        if (begin >= end) continue;
        std::vector<A>& acc = dkv_acc[t];
        acc.assign(s_kv * d, A(0));
        std::fill(dsink_acc[t].begin(), dsink_acc[t].end(), A(0));
        used[t] = 1;
        BwdRows rows{q_b, kv_b, idx_b, len_b, sink_b, out_b, lse_b, dout_b, dq_b,
                     acc.data(), dsink_acc[t].data(), begin, end};
        kern.backward(DtypeOf<T>(), shape, rows);
      }
    };
    ParallelFor(pool, max_workers, 1, max_workers, body);

    T* dkv_b = dkv + b * s_kv * d;
    A* dsink_dst = dsink_total.data() + (b / dsink_div) * h;
    std::vector<A>* first = nullptr;
    for (int w = 0; w < max_workers; ++w) {
      if (!used[w]) continue;
      if (!first) {
        first = &dkv_acc[w];
      } else {
        for (int64_t i = 0; i < s_kv * d; ++i) (*first)[i] += dkv_acc[w][i];
      }
      for (int64_t i = 0; i < h; ++i) dsink_dst[i] += dsink_acc[w][i];
    }
    for (int64_t i = 0; i < s_kv * d; ++i) dkv_b[i] = FromAcc<T, A>(first ? (*first)[i] : A(0));
  }
  std::copy(dsink_total.begin(), dsink_total.end(), dsink);
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer kv,
                        ffi::Buffer<ffi::S32> indices, ffi::AnyBuffer sink,
                        ffi::Buffer<ffi::S32> lengths, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dkv,
                        ffi::Result<ffi::AnyBuffer> dsink, double sm_scale, int64_t d_v) {
  JAX_DSA_RETURN_IF_ERROR(CheckFloatTypes(q.element_type(), sink.element_type(), "attn_sink"));
  Problem p;
  auto dqd = dq->dimensions();
  if (dqd.size() < 3) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): result dq must be [..., S_q, H, D_qk]");
  }
  JAX_DSA_RETURN_IF_ERROR(SetUp(q, kv, indices, sink, lengths, dqd, d_v, &p));
  BatchMap out_map, lse_map, dout_map;
  JAX_DSA_RETURN_IF_ERROR(CheckCore("out", out.dimensions(), {p.s_q, p.h, p.d_v}));
  JAX_DSA_RETURN_IF_ERROR(CheckCore("lse", lse.dimensions(), {p.s_q, p.h}));
  JAX_DSA_RETURN_IF_ERROR(CheckCore("dout", dout.dimensions(), {p.s_q, p.h, p.d_v}));
  JAX_DSA_RETURN_IF_ERROR(MapArg("out", out.dimensions(), 3, p.lead, false, true, &out_map));
  JAX_DSA_RETURN_IF_ERROR(MapArg("lse", lse.dimensions(), 2, p.lead, false, true, &lse_map));
  JAX_DSA_RETURN_IF_ERROR(MapArg("dout", dout.dimensions(), 3, p.lead, false, true, &dout_map));
  if (out.element_type() != q.element_type() || dout.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): out and dout must have q's dtype");
  }
  JAX_DSA_RETURN_IF_ERROR(CheckOutput("dq", dqd, Concat(p.lead.dims, {p.s_q, p.h, p.d})));
  JAX_DSA_RETURN_IF_ERROR(CheckOutput("dkv", dkv->dimensions(), Concat(p.lead.dims, {p.s_kv, p.d})));
  if (dq->element_type() != q.element_type() || dkv->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): results dq, dkv must have q's dtype");
  }
  if (dsink->element_type() != sink.element_type()) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): result d_attn_sink must have attn_sink's dtype");
  }
  // d_attn_sink: a left-aligned prefix of the call's leading dims, then [H].
  auto sd = dsink->dimensions();
  Lead dsink_lead;
  if (sd.size() < 1 || sd.size() - 1 > p.lead.dims.size() || sd[sd.size() - 1] != p.h ||
      !std::equal(sd.begin(), sd.end() - 1, p.lead.dims.begin())) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): result d_attn_sink has shape " +
                                       DimsStr(sd) + ", expected a prefix of the leading dims " +
                                       DimsStr(p.lead.dims) + " then H");
  }
  dsink_lead.dims.assign(sd.begin(), sd.end() - 1);
  for (int64_t x : dsink_lead.dims) dsink_lead.count *= x;

  const int32_t* idx = indices.typed_data();
  const int32_t* len = lengths.typed_data();
  const float* l = lse.typed_data();
#define JAX_DSA_BWD(T, A)                                                                      \
  Backward<T>(pool, p, static_cast<const T*>(q.untyped_data()),                                \
              static_cast<const T*>(kv.untyped_data()), idx,                                   \
              static_cast<const A*>(sink.untyped_data()), len,                                 \
              static_cast<const T*>(out.untyped_data()), l,                                    \
              static_cast<const T*>(dout.untyped_data()), out_map, lse_map, dout_map,          \
              static_cast<T*>(dq->untyped_data()), static_cast<T*>(dkv->untyped_data()),       \
              static_cast<A*>(dsink->untyped_data()), dsink_lead, sm_scale)
  switch (q.element_type()) {
    case ffi::DataType::F32: return JAX_DSA_BWD(float, float);
    case ffi::DataType::F64: return JAX_DSA_BWD(double, double);
    case ffi::DataType::BF16: return JAX_DSA_BWD(bf16_t, float);
    case ffi::DataType::F16: return JAX_DSA_BWD(f16_t, float);
    default:
      return ffi::Error::InvalidArgument("jax_dsa sparse_mla (cpu): unsupported q dtype");
  }
#undef JAX_DSA_BWD
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCpu, jax_dsa::ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // kv
                                  .Arg<ffi::Buffer<ffi::S32>>()   // indices
                                  .Arg<ffi::AnyBuffer>()          // attn_sink
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_length
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::Buffer<ffi::F32>>()   // max_logits
                                  .Attr<double>("sm_scale")
                                  .Attr<int64_t>("d_v"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdCpu, jax_dsa::BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // kv
                                  .Arg<ffi::Buffer<ffi::S32>>()   // indices
                                  .Arg<ffi::AnyBuffer>()          // attn_sink
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_length
                                  .Arg<ffi::AnyBuffer>()          // out
                                  .Arg<ffi::Buffer<ffi::F32>>()   // lse
                                  .Arg<ffi::AnyBuffer>()          // dout
                                  .Ret<ffi::AnyBuffer>()          // dq
                                  .Ret<ffi::AnyBuffer>()          // dkv
                                  .Ret<ffi::AnyBuffer>()          // d_attn_sink
                                  .Attr<double>("sm_scale")
                                  .Attr<int64_t>("d_v"));

namespace jax_dsa {

const char* KernelIsa() { return Kernels().isa; }

bool UseKernelIsa(const std::string& name) {
  if (name == "baseline") {
    g_kernels.store(&BaselineKernels(), std::memory_order_release);
  } else if (name == "native") {
    g_kernels.store(nullptr, std::memory_order_release);
  } else {
    return false;
  }
  return true;
}

}  // namespace jax_dsa
