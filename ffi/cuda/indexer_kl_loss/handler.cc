// XLA FFI handlers of the indexer KL loss on SM90 (kernels and contract: kernels.cu, launch.h),
// registered by ffi/cuda/module_cuda_indexer.cc:
//   jax_dsa_indexer_kl_fwd_cuda: (q, kv, iq, ik, w, idx, q_pos, kv_pos, q_seg, kv_seg)
//       -> (mass [ceil(H / 64), T, K] f32, score [T, K] f32); attrs sm_scale (f32), s_q, s_kv (i64)
//   jax_dsa_indexer_v4_kl_fwd_cuda: (q, kv, iq, ik, w, idx, q_pos, kv_pos, q_seg, kv_seg, lse)
//       -> (log mass [ceil(H / 64), T, K] f32, score [T, K] f32); lse [T, H] f32; same attrs
//   jax_dsa_indexer_score_cuda: the forward's operands -> score [T, K] f32 alone; same attrs
//   jax_dsa_indexer_kl_bwd_cuda: (iq, ik, w, idx, dscore)
//       -> (d_iq [T, H_I, 128] f32, d_ik [NB * s_kv, 128] f32, d_w [T, H_I] f32); attrs s_q, s_kv
//   jax_dsa_indexer_kl_dense_bwd_cuda: (iq, ik, w, idx, target [T, K] f32, index_lse [T] f32)
//       -> (d_iq, d_ik, d_w as above, score [T, K] f32); the dense form (BwdArgs::index_lse)
//   jax_dsa_indexer_kl_bwd_det_cuda, jax_dsa_indexer_kl_dense_bwd_det_cuda: the same in the
//       deterministic mode, with one more operand, fixed_scale [1] f32, and one more result, a
//       workspace of NB * s_kv * 1028 bytes (BwdArgs::d_ik_fixed, 128 int64 a row, then
//       BwdArgs::d_ik_nonfinite, one uint32 a row)
// Flat rows: T = NB * s_q query rows, NB * s_kv key rows (batch element b's keys are rows
// b * s_kv ...; idx holds per-batch key indices). Segment ids are [T] / [NB * s_kv] int32, or both
// empty ([0]) for none. Run on XLA's stream; no allocation, no synchronisation.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/indexer_kl_loss/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace indexer_kl {
namespace {

ffi::Error Invalid(const char* which, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string("jax_dsa indexer_kl_loss cuda ") + which + ": " +
                                     msg);
}

ffi::Error CudaError(const char* which, cudaError_t e) {
  return ffi::Error::Internal(std::string("jax_dsa indexer_kl_loss cuda ") + which +
                              ": launch failed: " + cudaGetErrorName(e) + " (" +
                              cudaGetErrorString(e) + ")");
}

#define JAX_DSA_KL_CHECK(cond, which, msg) \
  do {                                     \
    if (!(cond)) return Invalid(which, msg); \
  } while (0)

// V3.2 (lse == nullptr) and V4 (lse [T, H]) forward.
ffi::Error ForwardImpl(const char* which, cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q,
                       ffi::Buffer<ffi::BF16, 2> kv, ffi::Buffer<ffi::BF16, 3> iq,
                       ffi::Buffer<ffi::BF16, 2> ik, ffi::Buffer<ffi::F32, 2> w,
                       ffi::Buffer<ffi::S32, 2> idx, ffi::Buffer<ffi::S32, 1> q_pos,
                       ffi::Buffer<ffi::S32, 1> kv_pos, ffi::Buffer<ffi::S32, 1> q_seg,
                       ffi::Buffer<ffi::S32, 1> kv_seg, const ffi::Buffer<ffi::F32, 2>* lse,
                       ffi::ResultBuffer<ffi::F32, 3>* mass, ffi::ResultBuffer<ffi::F32, 2> score,
                       float sm_scale, int64_t s_q, int64_t s_kv) {
  const int64_t t = q.dimensions()[0], h = q.dimensions()[1], d = q.dimensions()[2];
  const int64_t nkv = kv.dimensions()[0], h_i = iq.dimensions()[1], k = idx.dimensions()[1];
  JAX_DSA_KL_CHECK(s_q >= 1 && s_kv >= 1, which, "attributes s_q and s_kv must be >= 1");
  JAX_DSA_KL_CHECK(t % s_q == 0 && nkv % s_kv == 0 && t / s_q == nkv / s_kv, which,
                   "q " + Dims(q.dimensions()) + " and kv " + Dims(kv.dimensions()) +
                       " must hold the same number of batch elements of s_q = " +
                       std::to_string(s_q) + " query and s_kv = " + std::to_string(s_kv) +
                       " key rows");
  JAX_DSA_KL_CHECK(Shaped(kv, {nkv, d}), which,
                   "kv " + Dims(kv.dimensions()) + " must be [NB * S_kv, D_qk = " +
                       std::to_string(d) + "]");
  JAX_DSA_KL_CHECK(Shaped(iq, {t, h_i, kIndexHeadDim}), which,
                   "index_q " + Dims(iq.dimensions()) + " must be [T = " + std::to_string(t) +
                       ", H_I, 128]");
  JAX_DSA_KL_CHECK(Shaped(ik, {nkv, kIndexHeadDim}), which,
                   "index_k " + Dims(ik.dimensions()) + " must be [NB * S_kv = " +
                       std::to_string(nkv) + ", 128]");
  JAX_DSA_KL_CHECK(Shaped(w, {t, h_i}), which,
                   "index_weights " + Dims(w.dimensions()) + " must be [T, H_I] = (" +
                       std::to_string(t) + ", " + std::to_string(h_i) + ")");
  JAX_DSA_KL_CHECK(Shaped(idx, {t, k}), which, "indices " + Dims(idx.dimensions()) + " must be [T, K]");
  JAX_DSA_KL_CHECK(Shaped(q_pos, {t}), which, "q_positions " + Dims(q_pos.dimensions()) + " must be [T]");
  JAX_DSA_KL_CHECK(Shaped(kv_pos, {nkv}), which,
                   "kv_positions " + Dims(kv_pos.dimensions()) + " must be [NB * S_kv]");
  const bool segs = q_seg.element_count() != 0 || kv_seg.element_count() != 0;
  JAX_DSA_KL_CHECK(!segs || (Shaped(q_seg, {t}) && Shaped(kv_seg, {nkv})), which,
                   "q_segment_ids " + Dims(q_seg.dimensions()) + " / kv_segment_ids " +
                       Dims(kv_seg.dimensions()) + " must be [T] / [NB * S_kv], or both [0]");
  JAX_DSA_KL_CHECK(lse == nullptr || Shaped(*lse, {t, h}), which,
                   "attention_lse " + (lse ? Dims(lse->dimensions()) : std::string()) +
                       " must be [T, H] = (" + std::to_string(t) + ", " + std::to_string(h) + ")");
  const int64_t groups = (h + 63) / 64;
  JAX_DSA_KL_CHECK((mass == nullptr || Shaped(**mass, {groups, t, k})) && Shaped(*score, {t, k}),
                   which,
                   "results must be mass [ceil(H / 64), T, K] = (" + std::to_string(groups) + ", " +
                       std::to_string(t) + ", " + std::to_string(k) + ") and score [T, K]");
  FwdArgs a{reinterpret_cast<const __nv_bfloat16*>(q.untyped_data()),
            reinterpret_cast<const __nv_bfloat16*>(kv.untyped_data()),
            reinterpret_cast<const __nv_bfloat16*>(iq.untyped_data()),
            reinterpret_cast<const __nv_bfloat16*>(ik.untyped_data()),
            w.typed_data(), idx.typed_data(), q_pos.typed_data(), kv_pos.typed_data(),
            segs ? q_seg.typed_data() : nullptr, segs ? kv_seg.typed_data() : nullptr,
            mass ? (*mass)->typed_data() : nullptr, score->typed_data(), t, h, d, h_i, k, s_q,
            s_kv, sm_scale,
            lse ? lse->typed_data() : nullptr};
  if (t == 0) return ffi::Error::Success();
  if (const char* why = FwdUnsupported(a)) return Invalid(which, why);
  cudaError_t e = LaunchFwd(a, stream);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError(which, e);
}

ffi::Error Forward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                   ffi::Buffer<ffi::BF16, 3> iq, ffi::Buffer<ffi::BF16, 2> ik,
                   ffi::Buffer<ffi::F32, 2> w, ffi::Buffer<ffi::S32, 2> idx,
                   ffi::Buffer<ffi::S32, 1> q_pos, ffi::Buffer<ffi::S32, 1> kv_pos,
                   ffi::Buffer<ffi::S32, 1> q_seg, ffi::Buffer<ffi::S32, 1> kv_seg,
                   ffi::ResultBuffer<ffi::F32, 3> mass, ffi::ResultBuffer<ffi::F32, 2> score,
                   float sm_scale, int64_t s_q, int64_t s_kv) {
  return ForwardImpl("forward", stream, q, kv, iq, ik, w, idx, q_pos, kv_pos, q_seg, kv_seg,
                     nullptr, &mass, score, sm_scale, s_q, s_kv);
}

ffi::Error Score(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                 ffi::Buffer<ffi::BF16, 3> iq, ffi::Buffer<ffi::BF16, 2> ik,
                 ffi::Buffer<ffi::F32, 2> w, ffi::Buffer<ffi::S32, 2> idx,
                 ffi::Buffer<ffi::S32, 1> q_pos, ffi::Buffer<ffi::S32, 1> kv_pos,
                 ffi::Buffer<ffi::S32, 1> q_seg, ffi::Buffer<ffi::S32, 1> kv_seg,
                 ffi::ResultBuffer<ffi::F32, 2> score, float sm_scale, int64_t s_q, int64_t s_kv) {
  return ForwardImpl("score", stream, q, kv, iq, ik, w, idx, q_pos, kv_pos, q_seg, kv_seg,
                     nullptr, nullptr, score, sm_scale, s_q, s_kv);
}

ffi::Error ForwardV4(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q,
                     ffi::Buffer<ffi::BF16, 2> kv, ffi::Buffer<ffi::BF16, 3> iq,
                     ffi::Buffer<ffi::BF16, 2> ik, ffi::Buffer<ffi::F32, 2> w,
                     ffi::Buffer<ffi::S32, 2> idx, ffi::Buffer<ffi::S32, 1> q_pos,
                     ffi::Buffer<ffi::S32, 1> kv_pos, ffi::Buffer<ffi::S32, 1> q_seg,
                     ffi::Buffer<ffi::S32, 1> kv_seg, ffi::Buffer<ffi::F32, 2> lse,
                     ffi::ResultBuffer<ffi::F32, 3> log_mass,
                     ffi::ResultBuffer<ffi::F32, 2> score, float sm_scale, int64_t s_q,
                     int64_t s_kv) {
  return ForwardImpl("v4 forward", stream, q, kv, iq, ik, w, idx, q_pos, kv_pos, q_seg, kv_seg,
                     &lse, &log_mass, score, sm_scale, s_q, s_kv);
}

// index_lse == nullptr: per_slot is dscore; else it is the target, and the kernel writes score.
ffi::Error BackwardImpl(const char* which, cudaStream_t stream, ffi::Buffer<ffi::BF16, 3>& iq,
                        ffi::Buffer<ffi::BF16, 2>& ik, ffi::Buffer<ffi::F32, 2>& w,
                        ffi::Buffer<ffi::S32, 2>& idx, ffi::Buffer<ffi::F32, 2>& per_slot,
                        ffi::Buffer<ffi::F32, 1>* index_lse, ffi::ResultBuffer<ffi::F32, 2>* score,
                        ffi::ResultBuffer<ffi::F32, 3>& d_iq, ffi::ResultBuffer<ffi::F32, 2>& d_ik,
                        ffi::ResultBuffer<ffi::F32, 2>& d_w, ffi::Buffer<ffi::F32, 1>* fixed_scale,
                        ffi::ResultBuffer<ffi::U8, 1>* workspace, int64_t s_q, int64_t s_kv) {
  const int64_t t = iq.dimensions()[0], h_i = iq.dimensions()[1];
  const int64_t nkv = ik.dimensions()[0], k = idx.dimensions()[1];
  JAX_DSA_KL_CHECK(s_q >= 1 && s_kv >= 1, which, "attributes s_q and s_kv must be >= 1");
  JAX_DSA_KL_CHECK(t % s_q == 0 && nkv % s_kv == 0 && t / s_q == nkv / s_kv, which,
                   "index_q " + Dims(iq.dimensions()) + " and index_k " + Dims(ik.dimensions()) +
                       " must hold the same number of batch elements of s_q = " +
                       std::to_string(s_q) + " query and s_kv = " + std::to_string(s_kv) +
                       " key rows");
  JAX_DSA_KL_CHECK(iq.dimensions()[2] == kIndexHeadDim, which,
                   "index_q " + Dims(iq.dimensions()) + " must be [T, H_I, 128]");
  JAX_DSA_KL_CHECK(Shaped(ik, {nkv, kIndexHeadDim}), which,
                   "index_k " + Dims(ik.dimensions()) + " must be [NB * S_kv, 128]");
  JAX_DSA_KL_CHECK(Shaped(w, {t, h_i}), which,
                   "index_weights " + Dims(w.dimensions()) + " must be [T, H_I]");
  JAX_DSA_KL_CHECK(Shaped(idx, {t, k}), which, "indices " + Dims(idx.dimensions()) + " must be [T, K]");
  const char* slot_name = index_lse ? "target " : "dscore ";
  JAX_DSA_KL_CHECK(Shaped(per_slot, {t, k}), which,
                   slot_name + Dims(per_slot.dimensions()) + " must be [T, K] like indices");
  if (index_lse) {
    JAX_DSA_KL_CHECK(Shaped(*index_lse, {t}), which,
                     "index_lse " + Dims(index_lse->dimensions()) + " must be [T]");
    JAX_DSA_KL_CHECK(Shaped(**score, {t, k}), which,
                     "score " + Dims((*score)->dimensions()) + " must be [T, K] like indices");
  }
  JAX_DSA_KL_CHECK(Shaped(*d_iq, {t, h_i, kIndexHeadDim}) && Shaped(*d_ik, {nkv, kIndexHeadDim}) &&
                       Shaped(*d_w, {t, h_i}),
                   which, "results must be d_iq [T, H_I, 128], d_ik [NB * S_kv, 128], d_w [T, H_I]");
  BwdArgs a{reinterpret_cast<const __nv_bfloat16*>(iq.untyped_data()),
            reinterpret_cast<const __nv_bfloat16*>(ik.untyped_data()),
            w.typed_data(), idx.typed_data(), index_lse ? nullptr : per_slot.typed_data(),
            d_iq->typed_data(), d_ik->typed_data(), d_w->typed_data(), t, h_i, k, s_q, s_kv};
  if (index_lse) {
    a.index_lse = index_lse->typed_data();
    a.target = per_slot.typed_data();
    a.score = (*score)->typed_data();
  }
  if (fixed_scale) {  // the deterministic mode
    const int64_t fixed_bytes = nkv * (kIndexHeadDim * 8 + 4);
    JAX_DSA_KL_CHECK(fixed_scale->element_count() == 1 &&
                         (*workspace)->element_count() == fixed_bytes,
                     which,
                     "the deterministic mode takes fixed_scale [1] and a workspace of " +
                         std::to_string(fixed_bytes) + " bytes; got " +
                         Dims(fixed_scale->dimensions()) + " and " +
                         Dims((*workspace)->dimensions()));
    a.d_ik_fixed = reinterpret_cast<unsigned long long*>((*workspace)->untyped_data());
    a.d_ik_nonfinite = reinterpret_cast<unsigned*>(a.d_ik_fixed + nkv * kIndexHeadDim);
    a.fixed_scale = fixed_scale->typed_data();
  }
  if (const char* why = BwdUnsupported(a)) return Invalid(which, why);
  cudaError_t e = LaunchBwd(a, stream);
  return e == cudaSuccess ? ffi::Error::Success() : CudaError(which, e);
}

ffi::Error Backward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> iq, ffi::Buffer<ffi::BF16, 2> ik,
                    ffi::Buffer<ffi::F32, 2> w, ffi::Buffer<ffi::S32, 2> idx,
                    ffi::Buffer<ffi::F32, 2> dscore, ffi::ResultBuffer<ffi::F32, 3> d_iq,
                    ffi::ResultBuffer<ffi::F32, 2> d_ik, ffi::ResultBuffer<ffi::F32, 2> d_w,
                    int64_t s_q, int64_t s_kv) {
  return BackwardImpl("backward", stream, iq, ik, w, idx, dscore, nullptr, nullptr, d_iq, d_ik,
                      d_w, nullptr, nullptr, s_q, s_kv);
}

ffi::Error DenseBackward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> iq,
                         ffi::Buffer<ffi::BF16, 2> ik, ffi::Buffer<ffi::F32, 2> w,
                         ffi::Buffer<ffi::S32, 2> idx, ffi::Buffer<ffi::F32, 2> target,
                         ffi::Buffer<ffi::F32, 1> index_lse, ffi::ResultBuffer<ffi::F32, 3> d_iq,
                         ffi::ResultBuffer<ffi::F32, 2> d_ik, ffi::ResultBuffer<ffi::F32, 2> d_w,
                         ffi::ResultBuffer<ffi::F32, 2> score, int64_t s_q, int64_t s_kv) {
  return BackwardImpl("dense backward", stream, iq, ik, w, idx, target, &index_lse, &score, d_iq,
                      d_ik, d_w, nullptr, nullptr, s_q, s_kv);
}

ffi::Error DeterministicBackward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> iq,
                                 ffi::Buffer<ffi::BF16, 2> ik, ffi::Buffer<ffi::F32, 2> w,
                                 ffi::Buffer<ffi::S32, 2> idx, ffi::Buffer<ffi::F32, 2> dscore,
                                 ffi::Buffer<ffi::F32, 1> fixed_scale,
                                 ffi::ResultBuffer<ffi::F32, 3> d_iq,
                                 ffi::ResultBuffer<ffi::F32, 2> d_ik,
                                 ffi::ResultBuffer<ffi::F32, 2> d_w,
                                 ffi::ResultBuffer<ffi::U8, 1> workspace, int64_t s_q, int64_t s_kv) {
  return BackwardImpl("deterministic backward", stream, iq, ik, w, idx, dscore, nullptr, nullptr,
                      d_iq, d_ik, d_w, &fixed_scale, &workspace, s_q, s_kv);
}

ffi::Error DeterministicDenseBackward(
    cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> iq, ffi::Buffer<ffi::BF16, 2> ik,
    ffi::Buffer<ffi::F32, 2> w, ffi::Buffer<ffi::S32, 2> idx, ffi::Buffer<ffi::F32, 2> target,
    ffi::Buffer<ffi::F32, 1> index_lse, ffi::Buffer<ffi::F32, 1> fixed_scale,
    ffi::ResultBuffer<ffi::F32, 3> d_iq, ffi::ResultBuffer<ffi::F32, 2> d_ik,
    ffi::ResultBuffer<ffi::F32, 2> d_w, ffi::ResultBuffer<ffi::F32, 2> score,
    ffi::ResultBuffer<ffi::U8, 1> workspace, int64_t s_q, int64_t s_kv) {
  return BackwardImpl("deterministic dense backward", stream, iq, ik, w, idx, target, &index_lse,
                      &score, d_iq, d_ik, d_w, &fixed_scale, &workspace, s_q, s_kv);
}

#undef JAX_DSA_KL_CHECK

}  // namespace
}  // namespace indexer_kl
}  // namespace jax_dsa

// The operands the forward-kernel targets share (mass, score and V4 add their results).
#define JAX_DSA_KL_FWD_ARGS                                    \
  ffi::Ffi::Bind()                                             \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                \
      .Arg<ffi::Buffer<ffi::BF16, 3>>() /* q */                \
      .Arg<ffi::Buffer<ffi::BF16, 2>>() /* kv */               \
      .Arg<ffi::Buffer<ffi::BF16, 3>>() /* index_q */          \
      .Arg<ffi::Buffer<ffi::BF16, 2>>() /* index_k */          \
      .Arg<ffi::Buffer<ffi::F32, 2>>()  /* index_weights */    \
      .Arg<ffi::Buffer<ffi::S32, 2>>()  /* indices */          \
      .Arg<ffi::Buffer<ffi::S32, 1>>()  /* q_positions */      \
      .Arg<ffi::Buffer<ffi::S32, 1>>()  /* kv_positions */     \
      .Arg<ffi::Buffer<ffi::S32, 1>>()  /* q_segment_ids */    \
      .Arg<ffi::Buffer<ffi::S32, 1>>()  /* kv_segment_ids */

#define JAX_DSA_KL_FWD_ATTRS                                   \
  .Attr<float>("sm_scale").Attr<int64_t>("s_q").Attr<int64_t>("s_kv")

#define JAX_DSA_KL_FWD_BINDING                                 \
  JAX_DSA_KL_FWD_ARGS                                          \
      .Ret<ffi::Buffer<ffi::F32, 3>>()  /* mass */             \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* score */            \
      JAX_DSA_KL_FWD_ATTRS

#define JAX_DSA_SCORE_BINDING                                  \
  JAX_DSA_KL_FWD_ARGS                                          \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* score */            \
      JAX_DSA_KL_FWD_ATTRS

#define JAX_DSA_V4_KL_FWD_BINDING                              \
  JAX_DSA_KL_FWD_ARGS                                          \
      .Arg<ffi::Buffer<ffi::F32, 2>>()  /* attention_lse */    \
      .Ret<ffi::Buffer<ffi::F32, 3>>()  /* log mass */         \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* score */            \
      JAX_DSA_KL_FWD_ATTRS

// The operands the backward targets share (the dense form adds index_lse and score).
#define JAX_DSA_KL_BWD_ARGS                                    \
  ffi::Ffi::Bind()                                             \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                \
      .Arg<ffi::Buffer<ffi::BF16, 3>>() /* index_q */          \
      .Arg<ffi::Buffer<ffi::BF16, 2>>() /* index_k */          \
      .Arg<ffi::Buffer<ffi::F32, 2>>()  /* index_weights */    \
      .Arg<ffi::Buffer<ffi::S32, 2>>()  /* indices */          \
      .Arg<ffi::Buffer<ffi::F32, 2>>()  /* dscore or target */

#define JAX_DSA_KL_BWD_RETS                                    \
      .Ret<ffi::Buffer<ffi::F32, 3>>()  /* d_index_q */        \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* d_index_k */        \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* d_index_weights */

#define JAX_DSA_KL_BWD_BINDING                                 \
  JAX_DSA_KL_BWD_ARGS                                          \
      JAX_DSA_KL_BWD_RETS                                      \
      .Attr<int64_t>("s_q")                                    \
      .Attr<int64_t>("s_kv")

#define JAX_DSA_KL_DENSE_BWD_BINDING                           \
  JAX_DSA_KL_BWD_ARGS                                          \
      .Arg<ffi::Buffer<ffi::F32, 1>>()  /* index_lse */        \
      JAX_DSA_KL_BWD_RETS                                      \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* score */            \
      .Attr<int64_t>("s_q")                                    \
      .Attr<int64_t>("s_kv")

#define JAX_DSA_KL_DET_BWD_BINDING                             \
  JAX_DSA_KL_BWD_ARGS                                          \
      .Arg<ffi::Buffer<ffi::F32, 1>>()  /* fixed_scale */      \
      JAX_DSA_KL_BWD_RETS                                      \
      .Ret<ffi::Buffer<ffi::U8, 1>>()   /* workspace */        \
      .Attr<int64_t>("s_q")                                    \
      .Attr<int64_t>("s_kv")

#define JAX_DSA_KL_DET_DENSE_BWD_BINDING                       \
  JAX_DSA_KL_BWD_ARGS                                          \
      .Arg<ffi::Buffer<ffi::F32, 1>>()  /* index_lse */        \
      .Arg<ffi::Buffer<ffi::F32, 1>>()  /* fixed_scale */      \
      JAX_DSA_KL_BWD_RETS                                      \
      .Ret<ffi::Buffer<ffi::F32, 2>>()  /* score */            \
      .Ret<ffi::Buffer<ffi::U8, 1>>()   /* workspace */        \
      .Attr<int64_t>("s_q")                                    \
      .Attr<int64_t>("s_kv")

// One memset (backward) and one launch on XLA's stream each: capture-safe.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerKlFwdCuda, jax_dsa::indexer_kl::Forward,
                              JAX_DSA_KL_FWD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerScoreCuda, jax_dsa::indexer_kl::Score,
                              JAX_DSA_SCORE_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerV4KlFwdCuda, jax_dsa::indexer_kl::ForwardV4,
                              JAX_DSA_V4_KL_FWD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerKlBwdCuda, jax_dsa::indexer_kl::Backward,
                              JAX_DSA_KL_BWD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerKlDenseBwdCuda, jax_dsa::indexer_kl::DenseBackward,
                              JAX_DSA_KL_DENSE_BWD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerKlDetBwdCuda, jax_dsa::indexer_kl::DeterministicBackward,
                              JAX_DSA_KL_DET_BWD_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerKlDetDenseBwdCuda,
                              jax_dsa::indexer_kl::DeterministicDenseBackward,
                              JAX_DSA_KL_DET_DENSE_BWD_BINDING, {ffi::Traits::kCmdBufferCompatible});
