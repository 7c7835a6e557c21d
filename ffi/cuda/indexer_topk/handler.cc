// XLA FFI handlers of the lightning indexer's top-k on SM90 (target jax_dsa_indexer_topk_cuda,
// registered by ffi/cuda/module_cuda_indexer.cc): validates the buffers and enqueues kernels.cu's
// kernels on XLA's stream (no allocation: the score buffer is the `workspace` result, sized by the
// glue; no synchronisation).
//
// Operands (jax_dsa/ops/indexer/topk/cuda.py): q [NB, S_q, H, 128] bf16 (H 32 or 64: heads
// padded with zero q and zero weight), k [NB, S_kv, 128] bf16, weights [NB, S_q, H] f32,
// q_pos [NB, S_q], kv_pos [NB, S_kv], q_seg [NB, S_q], kv_seg [NB, S_kv] int32 (zeros for no
// segments). Results: indices [NB, S_q, K] int32 (K <= 2048), workspace [W] u8 with
// W = workspace_bytes(S_kv, chunk_rows), scores [NB, S_q, K] f32 (the selected keys' scores, -inf
// past the visible count) or [0, 0, 0] (not written). Attribute chunk_rows: query rows per score
// chunk.
//
// jax_dsa_indexer_lse_cuda (the dense indexer KL loss's normaliser): the same operands; results
// lse [NB, S_q] f32 (log sum over the visible keys of exp(score), -inf for none) and workspace
// [W] u8 with W = index_lse_workspace_bytes(S_kv, S_q).

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/indexer_topk/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace indexer {
namespace {

constexpr const char* kWho = "jax_dsa indexer_topk cuda: ";

ffi::Error Invalid(const std::string& msg) { return ffi::Error::InvalidArgument(kWho + msg); }

ffi::Error TopkInitialize(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  cudaError_t e = TopkPrepare();
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kWho) + "preparing the kernels: " + cudaGetErrorName(e) +
                              " (" + cudaGetErrorString(e) + ")");
}

// The score inputs' shapes (shared by the top-k and the log-sum-exp handlers).
ffi::Error CheckInputs(const ffi::Buffer<ffi::BF16, 4>& q, const ffi::Buffer<ffi::BF16, 3>& k,
                       const ffi::Buffer<ffi::F32, 3>& w, const ffi::Buffer<ffi::S32, 2>& q_pos,
                       const ffi::Buffer<ffi::S32, 2>& kv_pos, const ffi::Buffer<ffi::S32, 2>& q_seg,
                       const ffi::Buffer<ffi::S32, 2>& kv_seg) {
  const auto qd = q.dimensions();
  const int64_t nb = qd[0], s_q = qd[1], h = qd[2], d = qd[3];
  const int64_t s_kv = k.dimensions()[1];
  if (d != kTopkHeadDim)
    return Invalid("q " + Dims(qd) + ": index_head_dim must be " + std::to_string(kTopkHeadDim));
  if (!TopkHeadsSupported(h))
    return Invalid("q " + Dims(qd) + ": index heads must be 32 or 64 (pad with zero q and weight)");
  if (!Shaped(k, {nb, s_kv, d}))
    return Invalid("k " + Dims(k.dimensions()) + " must be [NB, S_kv, 128] with q's NB");
  if (!Shaped(w, {nb, s_q, h}))
    return Invalid("weights " + Dims(w.dimensions()) + " must be [NB, S_q, H] = " +
                   Dims(qd.first(3)));
  if (!Shaped(q_pos, {nb, s_q})) return Invalid("q_pos " + Dims(q_pos.dimensions()) + " must be [NB, S_q]");
  if (!Shaped(q_seg, {nb, s_q})) return Invalid("q_seg " + Dims(q_seg.dimensions()) + " must be [NB, S_q]");
  if (!Shaped(kv_pos, {nb, s_kv})) return Invalid("kv_pos " + Dims(kv_pos.dimensions()) + " must be [NB, S_kv]");
  if (!Shaped(kv_seg, {nb, s_kv})) return Invalid("kv_seg " + Dims(kv_seg.dimensions()) + " must be [NB, S_kv]");
  if (s_kv < 1 || s_kv > kTopkMaxSkv)
    return Invalid("S_kv = " + std::to_string(s_kv) + " must be in [1, " + std::to_string(kTopkMaxSkv) + "]");
  if (s_q > (int64_t(1) << 31) / 8 || nb * s_q * h > (int64_t(1) << 40))
    return Invalid("S_q = " + std::to_string(s_q) + " is too large");
  return ffi::Error::Success();
}

ffi::Error Topk(cudaStream_t stream, ffi::Buffer<ffi::BF16, 4> q, ffi::Buffer<ffi::BF16, 3> k,
                ffi::Buffer<ffi::F32, 3> w, ffi::Buffer<ffi::S32, 2> q_pos,
                ffi::Buffer<ffi::S32, 2> kv_pos, ffi::Buffer<ffi::S32, 2> q_seg,
                ffi::Buffer<ffi::S32, 2> kv_seg, ffi::ResultBuffer<ffi::S32, 3> out,
                ffi::ResultBuffer<ffi::U8, 1> workspace, ffi::ResultBuffer<ffi::F32, 3> scores,
                int64_t chunk_rows) {
  const auto qd = q.dimensions();
  const int64_t nb = qd[0], s_q = qd[1], h = qd[2];
  const int64_t s_kv = k.dimensions()[1];
  const int64_t topk = out->dimensions()[2];
  if (ffi::Error e = CheckInputs(q, k, w, q_pos, kv_pos, q_seg, kv_seg); e.failure()) return e;
  if (!Shaped(*out, {nb, s_q, topk}))
    return Invalid("indices " + Dims(out->dimensions()) + " must be [NB, S_q, K]");
  const bool with_scores = scores->element_count() != 0;
  if (with_scores && !Shaped(*scores, {nb, s_q, topk}))
    return Invalid("scores " + Dims(scores->dimensions()) + " must be [NB, S_q, K] or empty");
  if (topk < 1 || topk > kTopkMaxK)
    return Invalid("K = " + std::to_string(topk) + " must be in [1, " + std::to_string(kTopkMaxK) + "]");
  if (chunk_rows < 1 || chunk_rows > (int64_t(1) << 30))
    return Invalid("chunk_rows = " + std::to_string(chunk_rows) + " must be >= 1");
  const size_t need = TopkWorkspaceBytes(s_kv, chunk_rows);
  if (workspace->dimensions()[0] != int64_t(need))
    return Invalid("workspace has " + std::to_string(workspace->dimensions()[0]) + " bytes, needs " +
                   std::to_string(need) + " for S_kv = " + std::to_string(s_kv) +
                   ", chunk_rows = " + std::to_string(chunk_rows));
  TopkLaunch a{q.untyped_data(), k.untyped_data(), w.typed_data(), q_pos.typed_data(),
               kv_pos.typed_data(), q_seg.typed_data(), kv_seg.typed_data(), out->typed_data(),
               workspace->untyped_data(), nb, s_q, s_kv, h, topk, chunk_rows, stream};
  a.out_scores = with_scores ? scores->typed_data() : nullptr;
  const char* what = "";
  cudaError_t e = LaunchTopk(a, &what);
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kWho) + what + ": " + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ")");
}

ffi::Error IndexLse(cudaStream_t stream, ffi::Buffer<ffi::BF16, 4> q, ffi::Buffer<ffi::BF16, 3> k,
                    ffi::Buffer<ffi::F32, 3> w, ffi::Buffer<ffi::S32, 2> q_pos,
                    ffi::Buffer<ffi::S32, 2> kv_pos, ffi::Buffer<ffi::S32, 2> q_seg,
                    ffi::Buffer<ffi::S32, 2> kv_seg, ffi::ResultBuffer<ffi::F32, 2> lse,
                    ffi::ResultBuffer<ffi::U8, 1> workspace) {
  const auto qd = q.dimensions();
  const int64_t nb = qd[0], s_q = qd[1], h = qd[2];
  const int64_t s_kv = k.dimensions()[1];
  if (ffi::Error e = CheckInputs(q, k, w, q_pos, kv_pos, q_seg, kv_seg); e.failure()) return e;
  if (!Shaped(*lse, {nb, s_q})) return Invalid("lse " + Dims(lse->dimensions()) + " must be [NB, S_q]");
  const size_t need = IndexLseWorkspaceBytes(s_kv, s_q);
  if (workspace->dimensions()[0] != int64_t(need))
    return Invalid("workspace has " + std::to_string(workspace->dimensions()[0]) + " bytes, needs " +
                   std::to_string(need) + " for S_kv = " + std::to_string(s_kv) + ", S_q = " +
                   std::to_string(s_q));
  TopkLaunch a{q.untyped_data(), k.untyped_data(), w.typed_data(), q_pos.typed_data(),
               kv_pos.typed_data(), q_seg.typed_data(), kv_seg.typed_data(), nullptr,
               workspace->untyped_data(), nb, s_q, s_kv, h, 1, s_q, stream};
  const char* what = "";
  cudaError_t e = LaunchIndexLse(a, lse->typed_data(), &what);
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kWho) + what + ": " + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ")");
}

}  // namespace
}  // namespace indexer
}  // namespace jax_dsa

// The score inputs (both targets).
#define JAX_DSA_INDEXER_SCORE_ARGS                  \
  ffi::Ffi::Bind()                                  \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()     \
      .Arg<ffi::Buffer<ffi::BF16, 4>>() /* q */      \
      .Arg<ffi::Buffer<ffi::BF16, 3>>() /* k */      \
      .Arg<ffi::Buffer<ffi::F32, 3>>()  /* w */      \
      .Arg<ffi::Buffer<ffi::S32, 2>>()  /* q_pos */  \
      .Arg<ffi::Buffer<ffi::S32, 2>>()  /* kv_pos */ \
      .Arg<ffi::Buffer<ffi::S32, 2>>()  /* q_seg */  \
      .Arg<ffi::Buffer<ffi::S32, 2>>()  /* kv_seg */

#define JAX_DSA_INDEXER_TOPK_BINDING                \
  JAX_DSA_INDEXER_SCORE_ARGS                        \
      .Ret<ffi::Buffer<ffi::S32, 3>>()  /* indices */ \
      .Ret<ffi::Buffer<ffi::U8, 1>>()   /* workspace */ \
      .Ret<ffi::Buffer<ffi::F32, 3>>()  /* scores */ \
      .Attr<int64_t>("chunk_rows")

// Capture-safe: kernel launches on XLA's stream only (the shared-memory limits are raised in
// INITIALIZE, and lazily once per device).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerTopkCuda, jax_dsa::indexer::Topk, JAX_DSA_INDEXER_TOPK_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerTopkCudaInit, jax_dsa::indexer::TopkInitialize,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());

// The index scores' log-sum-exp (jax_dsa_indexer_lse_cuda): the top-k's inputs; results
// lse [NB, S_q] f32 and workspace [IndexLseWorkspaceBytes(S_kv, S_q)] u8.
#define JAX_DSA_INDEXER_LSE_BINDING                 \
  JAX_DSA_INDEXER_SCORE_ARGS                        \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* lse */    \
      .Ret<ffi::Buffer<ffi::U8, 1>>()   /* workspace */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerLseCuda, jax_dsa::indexer::IndexLse, JAX_DSA_INDEXER_LSE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
