// XLA FFI handlers of the CUDA sparse MLA forward: jax_dsa's own SM90 kernel
// (sparse_mla_fwd_sm90.py, CuTe DSL), compiled ahead of time by ffi/cuda/export/
// export_sparse_mla_fwd.py and launched here on XLA's stream with no compiler, no PyTorch and no
// allocation at run time. Targets (registered by ffi/cuda/module_cuda.cc):
//   jax_dsa_sparse_mla_fwd_cuda     sparse_mla's forward (slot lists)
//   jax_dsa_dense_mla_fwd_cuda      dense_mla's forward (contiguous runs of kv rows)
//   jax_dsa_sparse_mla_target_cuda  the indexer loss's target over slot lists
//
// Contract (FlashMLA v2 sparse prefill; the glue in jax_dsa/ops/sparse_mla prepares it): flat
// tokens, bf16, H, D_qk and d_v as compiled (jax_dsa/kernel_spec.py: H 64 or 128, D_qk 512 or
// 576, d_v 512), indices [S_q, K] (K >= 1 a multiple of 4: the kernel prefetches each row of slot
// ids as one 16-byte-aligned block; a slot is used iff its position < topk_length and
// 0 <= index < S_kv), attn_sink [H] (-inf for none). Results: out [S_q, H, 512] bf16, lse
// [S_q, H] natural log and sink-free (+inf for rows without a valid slot), max_logits [S_q, H]
// (-inf for such rows). The benchmarks' raw-pointer entry is in ffi/cuda/bench/
// sparse_mla_fwd_bench.cc (a separate library), not in this module.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/sparse_mla_fwd/launch.h"
#include "common/ffi_shapes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

ffi::Error FwdCudaError(const std::string& what, cudaError_t e) {
  return ffi::Error::Internal("jax_dsa sparse_mla cuda forward: " + what + ": " + cudaGetErrorName(e) +
                              " (" + cudaGetErrorString(e) + ")");
}

ffi::Error FwdInvalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_dsa sparse_mla cuda forward: " + msg);
}

ffi::Error FwdInitialize(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  cudaError_t e = LoadFwdKernels();
  return e == cudaSuccess ? ffi::Error::Success() : FwdCudaError("loading the kernel modules", e);
}

// The checks every forward-kernel handler shares: the slot operands' shapes against q
// [S_q, H, D], and (for a non-empty call) K, the 32-bit extents, the compiled variant and its
// modules; *kern is the variant to launch.
ffi::Error CheckSlotsAndFind(ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                             ffi::Buffer<ffi::S32, 2> indices, ffi::Buffer<ffi::S32, 1> topk_length,
                             bool contiguous, bool target, const SparseMlaFwdKernel** kern) {
  const int64_t s_q = q.dimensions()[0], h = q.dimensions()[1], d = q.dimensions()[2];
  const int64_t s_kv = kv.dimensions()[0], k = indices.dimensions()[1];
  if (!Shaped(kv, {s_kv, d})) return FwdInvalid("kv " + Dims(kv.dimensions()) + " must be [S_kv, D_qk=" + std::to_string(d) + "]");
  if (!Shaped(indices, {s_q, k})) return FwdInvalid("indices " + Dims(indices.dimensions()) + " must be [S_q, K]");
  if (!Shaped(topk_length, {s_q})) return FwdInvalid("topk_length " + Dims(topk_length.dimensions()) + " must be [S_q]");
  *kern = nullptr;
  if (s_q == 0) return ffi::Error::Success();
  if (s_kv < 1 || k < 1) return FwdInvalid("S_kv and K must be >= 1");
  if (k % kSparseMlaFwdKMultiple != 0)
    return FwdInvalid("K = " + std::to_string(k) + " must be a multiple of " +
                      std::to_string(kSparseMlaFwdKMultiple) + " (pad indices with -1)");
  // (the kernel's tile walk adds the grid size to a tile index)
  if (s_q * (h / 64) > INT32_MAX - 4096 || s_kv > INT32_MAX || k > INT32_MAX || s_q * k > INT32_MAX)
    return FwdInvalid("sizes too large for the 32-bit extents of the compiled kernels");
  *kern = FindFwd(int(h), int(d), contiguous, target);
  if (!*kern)
    return FwdInvalid("no compiled kernel for H=" + std::to_string(h) + ", D_qk=" + std::to_string(d) +
                      " (" + kSparseMlaFwdSupported + ")");
  if (cudaError_t e = LoadFwdKernels(); e != cudaSuccess) return FwdCudaError("loading the kernel modules", e);
  return ffi::Error::Success();
}

// contiguous: the dense mode (jax_dsa_dense_mla_fwd_cuda): query s's slots are the kv rows
// indices[s, 0] + j for j < topk_length[s] (the glue in jax_dsa/ops/dense_mla makes the runs).
ffi::Error ForwardImpl(bool contiguous, cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q,
                       ffi::Buffer<ffi::BF16, 2> kv, ffi::Buffer<ffi::S32, 2> indices,
                       ffi::Buffer<ffi::S32, 1> topk_length, ffi::Buffer<ffi::F32, 1> attn_sink,
                       ffi::ResultBuffer<ffi::BF16, 3> out, ffi::ResultBuffer<ffi::F32, 2> lse,
                       ffi::ResultBuffer<ffi::F32, 2> max_logits, float sm_scale) {
  const int64_t s_q = q.dimensions()[0], h = q.dimensions()[1], d = q.dimensions()[2];
  const int64_t s_kv = kv.dimensions()[0], k = indices.dimensions()[1];
  if (!Shaped(attn_sink, {h})) return FwdInvalid("attn_sink " + Dims(attn_sink.dimensions()) + " must be [H]");
  if (!Shaped(*out, {s_q, h, kSparseMlaFwdDv}) || !Shaped(*lse, {s_q, h}) || !Shaped(*max_logits, {s_q, h}))
    return FwdInvalid("results must be out [S_q, H, " + std::to_string(kSparseMlaFwdDv) +
                      "], lse [S_q, H], max_logits [S_q, H]");
  const SparseMlaFwdKernel* kern = nullptr;
  if (ffi::Error e = CheckSlotsAndFind(q, kv, indices, topk_length, contiguous, false, &kern);
      e.failure() || kern == nullptr)
    return e;
  SparseMlaFwdLaunch a{q.untyped_data(), kv.untyped_data(), indices.typed_data(), topk_length.typed_data(),
                       attn_sink.typed_data(), out->untyped_data(), lse->typed_data(),
                       max_logits->typed_data(), int32_t(s_q), int32_t(s_kv), int32_t(k), sm_scale, stream,
                       NumSms()};
  std::string what;
  cudaError_t e = LaunchFwd(kern, a, &what);
  return e == cudaSuccess ? ffi::Error::Success() : FwdCudaError(what, e);
}

ffi::Error Forward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                   ffi::Buffer<ffi::S32, 2> indices, ffi::Buffer<ffi::S32, 1> topk_length,
                   ffi::Buffer<ffi::F32, 1> attn_sink, ffi::ResultBuffer<ffi::BF16, 3> out,
                   ffi::ResultBuffer<ffi::F32, 2> lse, ffi::ResultBuffer<ffi::F32, 2> max_logits,
                   float sm_scale) {
  return ForwardImpl(false, stream, q, kv, indices, topk_length, attn_sink, out, lse, max_logits,
                     sm_scale);
}

ffi::Error DenseForward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                        ffi::Buffer<ffi::S32, 2> indices, ffi::Buffer<ffi::S32, 1> topk_length,
                        ffi::Buffer<ffi::F32, 1> attn_sink, ffi::ResultBuffer<ffi::BF16, 3> out,
                        ffi::ResultBuffer<ffi::F32, 2> lse, ffi::ResultBuffer<ffi::F32, 2> max_logits,
                        float sm_scale) {
  return ForwardImpl(true, stream, q, kv, indices, topk_length, attn_sink, out, lse, max_logits,
                     sm_scale);
}

// The indexer loss's target (jax_dsa_sparse_mla_target_cuda): the same slots as the forward, lse
// [S_q, H] an input (natural log, sink-free, +inf for no slot), mass [S_q * H / 64, K] float32
// with mass[s * H / 64 + g, j] = sum over the 64 heads of group g of exp(sm_scale * q . kv - lse)
// for the valid slots j < topk_length[s] (0 for invalid ones; columns past topk_length unwritten).
ffi::Error SparseTarget(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                        ffi::Buffer<ffi::S32, 2> indices, ffi::Buffer<ffi::S32, 1> topk_length,
                        ffi::Buffer<ffi::F32, 2> lse, ffi::ResultBuffer<ffi::F32, 2> mass,
                        float sm_scale) {
  const int64_t s_q = q.dimensions()[0], h = q.dimensions()[1];
  const int64_t s_kv = kv.dimensions()[0], k = indices.dimensions()[1];
  const int64_t rows = mass->dimensions()[0], cols = mass->dimensions()[1];
  if (!Shaped(lse, {s_q, h})) return FwdInvalid("lse " + Dims(lse.dimensions()) + " must be [S_q, H]");
  if (h % 64 != 0 || rows != s_q * (h / 64) || cols != k)
    return FwdInvalid("mass " + Dims(mass->dimensions()) + " must be [S_q * H / 64, K]");
  if (cols > INT32_MAX || rows * cols > INT32_MAX)
    return FwdInvalid("sizes too large for the 32-bit extents of the compiled kernels");
  if (cols == 0) return ffi::Error::Success();
  const SparseMlaFwdKernel* kern = nullptr;
  if (ffi::Error e = CheckSlotsAndFind(q, kv, indices, topk_length, false, true, &kern);
      e.failure() || kern == nullptr)
    return e;
  // lse is read, not written, in target mode; attn_sink and max_logits are not touched
  float* lse_in = const_cast<float*>(lse.typed_data());
  SparseMlaFwdLaunch a{q.untyped_data(), kv.untyped_data(), indices.typed_data(), topk_length.typed_data(),
                       lse_in, mass->untyped_data(), lse_in, lse_in, int32_t(s_q), int32_t(s_kv),
                       int32_t(k), sm_scale, stream, NumSms(), int32_t(rows), int32_t(cols)};
  std::string what;
  cudaError_t e = LaunchFwd(kern, a, &what);
  return e == cudaSuccess ? ffi::Error::Success() : FwdCudaError(what, e);
}

}  // namespace
}  // namespace jax_dsa

#define JAX_DSA_FWD_BINDING                                          \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                      \
      .Arg<ffi::Buffer<ffi::BF16, 3>>()  /* q */                     \
      .Arg<ffi::Buffer<ffi::BF16, 2>>()  /* kv */                    \
      .Arg<ffi::Buffer<ffi::S32, 2>>()   /* indices */               \
      .Arg<ffi::Buffer<ffi::S32, 1>>()   /* topk_length */           \
      .Arg<ffi::Buffer<ffi::F32, 1>>()   /* attn_sink */             \
      .Ret<ffi::Buffer<ffi::BF16, 3>>()  /* out */                   \
      .Ret<ffi::Buffer<ffi::F32, 2>>()   /* lse */                   \
      .Ret<ffi::Buffer<ffi::F32, 2>>()   /* max_logits */            \
      .Attr<float>("sm_scale")

// Capture-safe: one kernel launch on XLA's stream (no allocation, no synchronisation), modules
// loaded in INITIALIZE, so every target carries the command-buffer trait.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCuda, jax_dsa::Forward, JAX_DSA_FWD_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaDenseMlaFwdCuda, jax_dsa::DenseForward, JAX_DSA_FWD_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
#define JAX_DSA_TARGET_BINDING                                       \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                      \
      .Arg<ffi::Buffer<ffi::BF16, 3>>()  /* q */                     \
      .Arg<ffi::Buffer<ffi::BF16, 2>>()  /* kv */                    \
      .Arg<ffi::Buffer<ffi::S32, 2>>()   /* indices */               \
      .Arg<ffi::Buffer<ffi::S32, 1>>()   /* topk_length */           \
      .Arg<ffi::Buffer<ffi::F32, 2>>()   /* lse */                   \
      .Ret<ffi::Buffer<ffi::F32, 2>>()   /* mass */                  \
      .Attr<float>("sm_scale")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaTargetCuda, jax_dsa::SparseTarget, JAX_DSA_TARGET_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCudaInit, jax_dsa::FwdInitialize,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
