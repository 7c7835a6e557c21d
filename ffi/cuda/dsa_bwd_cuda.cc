// XLA FFI handler for the CUDA sparse MLA backward: the cuDNN frontend's SM90 DSA backward
// (nvidia-cudnn-frontend 1.32.0, cudnn/deepseek_sparse_attention/sparse_attention_backward/
// dsa_bwd_sm90.py), compiled ahead of time by export_dsa_bwd.py and launched here with no
// compiler, no PyTorch and no allocation at run time.
//
// Contract (the public op's glue in jax_dsa/ops/sparse_mla prepares it): flat tokens, bf16,
// H, D_qk and d_v as compiled (jax_dsa/kernel_spec.py: H 64 or 128, D_qk 512 or 576, d_v 512),
// indices [S_q, K] (K a compiled slot bucket, else the wide variant), valid slots a prefix of length
// topk_length >= 1, lse natural-log and sink-free (+inf for rows without valid slots),
// attn_sink -inf for no sink. The workspace is an output sized by WorkspaceBytes (the
// frontend's flash_attn_bwd_sm90_workspace_size). The benchmarks' raw-pointer entry is in
// bench/dsa_bwd_bench.cc (a separate library), not in this module.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <nanobind/nanobind.h>

#include "cuda/dsa_bwd_launch.h"
#include "cuda/slot_compact.h"
#include "cuda/sparse_mla_fwd_variants.h"
#include "common/ffi_shapes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

ffi::Error CudaError(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_dsa sparse_mla cuda backward: ") + what + ": " +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_dsa sparse_mla cuda backward: " + msg);
}

// Modules are loaded here, outside any CUDA-graph capture (and, as a fallback, before the first
// launch).
ffi::Error Initialize(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  cudaError_t e = LoadBwdKernels();
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("loading the kernel modules", e);
}

ffi::Error Backward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                    ffi::Buffer<ffi::BF16, 3> out, ffi::Buffer<ffi::BF16, 3> dout,
                    ffi::Buffer<ffi::F32, 2> lse, ffi::Buffer<ffi::F32, 1> attn_sink,
                    ffi::Buffer<ffi::S32, 2> indices, ffi::Buffer<ffi::S32, 1> topk_length,
                    ffi::ResultBuffer<ffi::BF16, 3> dq, ffi::ResultBuffer<ffi::BF16, 2> dkv,
                    ffi::ResultBuffer<ffi::F32, 1> d_sink, ffi::ResultBuffer<ffi::U8, 1> workspace,
                    float sm_scale) {
  const int64_t s_q = q.dimensions()[0], h = q.dimensions()[1], d = q.dimensions()[2];
  const int64_t s_kv = kv.dimensions()[0], k = indices.dimensions()[1];
  if (!Shaped(kv, {s_kv, d})) return Invalid("kv " + Dims(kv.dimensions()) + " must be [S_kv, D_qk=" + std::to_string(d) + "]");
  const std::string dv = std::to_string(kDsaBwdDv);
  if (!Shaped(out, {s_q, h, kDsaBwdDv})) return Invalid("out " + Dims(out.dimensions()) + " must be [S_q, H, " + dv + "]");
  if (!Shaped(dout, {s_q, h, kDsaBwdDv})) return Invalid("dout " + Dims(dout.dimensions()) + " must be [S_q, H, " + dv + "]");
  if (!Shaped(lse, {s_q, h})) return Invalid("lse " + Dims(lse.dimensions()) + " must be [S_q, H]");
  if (!Shaped(attn_sink, {h})) return Invalid("attn_sink " + Dims(attn_sink.dimensions()) + " must be [H]");
  if (!Shaped(indices, {s_q, k})) return Invalid("indices " + Dims(indices.dimensions()) + " must be [S_q, K]");
  if (!Shaped(topk_length, {s_q})) return Invalid("topk_length " + Dims(topk_length.dimensions()) + " must be [S_q]");
  if (!Shaped(*dq, {s_q, h, d}) || !Shaped(*dkv, {s_kv, d}) || !Shaped(*d_sink, {h}))
    return Invalid("results dq, dkv, d_attn_sink must be shaped like q, kv, attn_sink");
  if (s_q < 1 || s_kv < 1) return Invalid("S_q and S_kv must be >= 1");
  if (s_q > INT32_MAX / 2 || s_kv > INT32_MAX / 2 || AccumElems(s_kv, d) > INT32_MAX ||
      k > INT32_MAX / 2 || s_q * k > INT32_MAX)
    return Invalid("sequence too long for the 32-bit extents of the compiled kernels");

  const DsaBwdKernel* pre = FindBwd(kPreKernels, kNumPreKernels, int(h), -1, -1);
  const DsaBwdKernel* post = FindBwd(kPostKernels, kNumPostKernels, -1, int(d), -1);
  const DsaBwdKernel* main = FindMainBwd(int(h), int(d), int(k));
  if (!pre || !post || !main) {
    return Invalid("no compiled kernel for H=" + std::to_string(h) + ", D_qk=" + std::to_string(d) +
                   ", K=" + std::to_string(k) + " (" + kDsaBwdSupported + ")");
  }
  const int64_t need = WorkspaceBytes(s_q, s_kv, h, d);
  if (workspace->element_count() < need) {
    return Invalid("workspace has " + std::to_string(workspace->element_count()) + " bytes, needs " +
                   std::to_string(need));
  }
  if (cudaError_t e = LoadBwdKernels(); e != cudaSuccess) return CudaError("loading the kernel modules", e);

  char* ws = static_cast<char*>(workspace->untyped_data());
  DsaBwdLaunch a;
  a.q = q.untyped_data();
  a.kv = kv.untyped_data();
  a.out = out.untyped_data();
  a.dout = dout.untyped_data();
  a.lse = lse.typed_data();
  a.attn_sink = attn_sink.typed_data();
  a.indices = indices.typed_data();
  a.topk_length = topk_length.typed_data();
  a.dq = dq->untyped_data();
  a.dkv = dkv->untyped_data();
  a.d_sink = d_sink->typed_data();
  a.dpsum = reinterpret_cast<float*>(ws);
  a.lse_log2 = reinterpret_cast<float*>(ws + StatsBytes(s_q, h));
  a.dkv_accum = reinterpret_cast<float*>(ws + 2 * StatsBytes(s_q, h));
  a.s_q = int32_t(s_q);
  a.s_kv = int32_t(s_kv);
  a.s_q_rounded = int32_t(RoundUp(s_q, kBwdTileM));
  a.dkv_accum_n = int32_t(AccumElems(s_kv, d));
  a.sm_scale = sm_scale;
  a.stream = stream;
  a.topk = int32_t(k);

  std::string what;
  cudaError_t e = LaunchBwd(a, int(h), pre, main, post, &what);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError(what.c_str(), e);
}

// The glue's stable partition of the slot lists (slot_compact.h): rows [T, K_in] -> [T, K_out],
// the entries >= 0 first in their order, -1 after (K_out >= K_in: the slot bucket's padding).
ffi::Error CompactSlots(cudaStream_t stream, ffi::Buffer<ffi::S32, 2> rows,
                        ffi::ResultBuffer<ffi::S32, 2> out) {
  const int64_t t = rows.dimensions()[0], k_in = rows.dimensions()[1], k_out = out->dimensions()[1];
  if (out->dimensions()[0] != t || k_out < k_in)
    return Invalid("compacted slots " + Dims(out->dimensions()) + " must be [T, K_out >= " +
                   std::to_string(k_in) + "] for rows " + Dims(rows.dimensions()));
  if (t > INT32_MAX || k_out > INT32_MAX / 2) return Invalid("too many slot rows or slots for 32-bit extents");
  cudaError_t e = LaunchCompactSlots(rows.typed_data(), out->typed_data(), t, k_in, k_out, stream);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError("compacting the slot lists", e);
}

}  // namespace
}  // namespace jax_dsa

#define JAX_DSA_COMPACT_BINDING                                      \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                      \
      .Arg<ffi::Buffer<ffi::S32, 2>>()   /* rows */                  \
      .Ret<ffi::Buffer<ffi::S32, 2>>()   /* compacted rows */

// One kernel launch on XLA's stream: capture-safe.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaCompactSlotsCuda, jax_dsa::CompactSlots, JAX_DSA_COMPACT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaCompactSlotsCudaNoGraph, jax_dsa::CompactSlots, JAX_DSA_COMPACT_BINDING);

#define JAX_DSA_BWD_BINDING                                          \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                      \
      .Arg<ffi::Buffer<ffi::BF16, 3>>()  /* q */                     \
      .Arg<ffi::Buffer<ffi::BF16, 2>>()  /* kv */                    \
      .Arg<ffi::Buffer<ffi::BF16, 3>>()  /* out */                   \
      .Arg<ffi::Buffer<ffi::BF16, 3>>()  /* dout */                  \
      .Arg<ffi::Buffer<ffi::F32, 2>>()   /* lse */                   \
      .Arg<ffi::Buffer<ffi::F32, 1>>()   /* attn_sink */             \
      .Arg<ffi::Buffer<ffi::S32, 2>>()   /* indices */               \
      .Arg<ffi::Buffer<ffi::S32, 1>>()   /* topk_length */           \
      .Ret<ffi::Buffer<ffi::BF16, 3>>()  /* dq */                    \
      .Ret<ffi::Buffer<ffi::BF16, 2>>()  /* dkv */                   \
      .Ret<ffi::Buffer<ffi::F32, 1>>()   /* d_attn_sink */           \
      .Ret<ffi::Buffer<ffi::U8, 1>>()    /* workspace */             \
      .Attr<float>("sm_scale")

// Execute is capture-safe (async memsets and kernel launches on XLA's stream, no allocation,
// no synchronisation; modules are loaded in INITIALIZE), so it may join CUDA graphs. A variant
// without the trait is exported for A/B checks (JAX_DSA_CUDA_GRAPHS=0 in jax_dsa._native).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaDsaBwdCuda, jax_dsa::Backward, JAX_DSA_BWD_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaDsaBwdCudaNoGraph, jax_dsa::Backward, JAX_DSA_BWD_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaDsaBwdCudaInit, jax_dsa::Initialize,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());

// The forward's handlers (sparse_mla_fwd_cuda.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCudaInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDenseMlaFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDenseMlaFwdCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaTargetCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaTargetCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDenseMlaTargetCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDenseMlaTargetCudaNoGraph);

namespace nb = nanobind;

NB_MODULE(_cuda, m) {
  m.doc() = "jax_dsa CUDA sparse MLA: own SM90 forward and the cuDNN frontend's SM90 DSA backward (AOT; XLA FFI API 0.4).";
  m.def("registrations", [](bool graphs) {
    nb::dict d, stages;
    stages["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaDsaBwdCudaInit));
    stages["execute"] = nb::capsule(reinterpret_cast<void*>(graphs ? JaxDsaDsaBwdCuda : JaxDsaDsaBwdCudaNoGraph));
    d["jax_dsa_dsa_bwd_cuda"] = stages;
    d["jax_dsa_compact_slots_cuda"] = nb::capsule(reinterpret_cast<void*>(graphs ? JaxDsaCompactSlotsCuda : JaxDsaCompactSlotsCudaNoGraph));
    nb::dict fwd;
    fwd["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaSparseMlaFwdCudaInit));
    fwd["execute"] = nb::capsule(reinterpret_cast<void*>(graphs ? JaxDsaSparseMlaFwdCuda : JaxDsaSparseMlaFwdCudaNoGraph));
    d["jax_dsa_sparse_mla_fwd_cuda"] = fwd;
    nb::dict dense;
    dense["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaSparseMlaFwdCudaInit));
    dense["execute"] = nb::capsule(reinterpret_cast<void*>(graphs ? JaxDsaDenseMlaFwdCuda : JaxDsaDenseMlaFwdCudaNoGraph));
    d["jax_dsa_dense_mla_fwd_cuda"] = dense;
    nb::dict sparse_target, dense_target;
    sparse_target["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaSparseMlaFwdCudaInit));
    sparse_target["execute"] = nb::capsule(reinterpret_cast<void*>(graphs ? JaxDsaSparseMlaTargetCuda : JaxDsaSparseMlaTargetCudaNoGraph));
    d["jax_dsa_sparse_mla_target_cuda"] = sparse_target;
    dense_target["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaSparseMlaFwdCudaInit));
    dense_target["execute"] = nb::capsule(reinterpret_cast<void*>(graphs ? JaxDsaDenseMlaTargetCuda : JaxDsaDenseMlaTargetCudaNoGraph));
    d["jax_dsa_dense_mla_target_cuda"] = dense_target;
    return d;
  }, nb::arg("graphs") = true);
  m.def("workspace_bytes", &jax_dsa::WorkspaceBytes, nb::arg("s_q"), nb::arg("s_kv"), nb::arg("h"), nb::arg("d"),
        "Bytes of the backward's workspace output (the frontend's SM90 formula).");
  m.def("variants", []() {
    nb::list l;
    for (int i = 0; i < jax_dsa::kNumMainKernels; ++i) {
      const auto& k = jax_dsa::kMainKernels[i];
      l.append(nb::make_tuple(k.h, k.d, k.topk));
    }
    return l;
  }, "(H, D_qk, slot bucket) of every compiled main kernel.");
  m.def("compiled_variants", []() {
    nb::dict d, fwd, bwd;
    nb::list fwd_v, main_v, pre_h, post_d;
    nb::list dense_v, target_v;
    for (int i = 0; i < jax_dsa::kNumSparseMlaFwdKernels; ++i) {
      const auto& k = jax_dsa::kSparseMlaFwdKernels[i];
      if (!k.target) (k.contiguous ? dense_v : fwd_v).append(nb::make_tuple(k.h, k.d));
      else target_v.append(nb::make_tuple(k.h, k.d, k.contiguous));
    }
    fwd["dense_variants"] = dense_v;
    fwd["target_variants"] = target_v;
    fwd["variants"] = fwd_v;
    fwd["d_v"] = jax_dsa::kSparseMlaFwdDv;
    fwd["k_multiple"] = jax_dsa::kSparseMlaFwdKMultiple;
    for (int i = 0; i < jax_dsa::kNumMainKernels; ++i) {
      const auto& k = jax_dsa::kMainKernels[i];
      main_v.append(nb::make_tuple(k.h, k.d, k.topk));
    }
    for (int i = 0; i < jax_dsa::kNumPreKernels; ++i) pre_h.append(jax_dsa::kPreKernels[i].h);
    for (int i = 0; i < jax_dsa::kNumPostKernels; ++i) post_d.append(jax_dsa::kPostKernels[i].d);
    bwd["variants"] = main_v;
    bwd["pre_heads"] = pre_h;
    bwd["post_d_qk"] = post_d;
    bwd["d_v"] = jax_dsa::kDsaBwdDv;
    d["forward"] = fwd;
    d["backward"] = bwd;
    return d;
  }, "What the dispatch tables hold: forward (H, D_qk) variants (slot lists; dense_variants: "
     "contiguous runs; target_variants: (H, D_qk, contiguous) of the indexer loss's target), d_v "
     "and K multiple; backward (H, D_qk, slot bucket; 0 = any K) main "
     "kernels, pre-pass heads, post-pass D_qk and d_v.");
  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("ARCH") = "sm_90a";
}
