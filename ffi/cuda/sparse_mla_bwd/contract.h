// The shapes of the sparse MLA backward's FFI contract, shared by its two handlers: the cuDNN
// frontend's kernels (dsa_bwd/handler.cc) and jax_dsa's own (sparse_mla_bwd/handler.cc). Operands
// q [S_q, H, D], kv [S_kv, D], out / dout [S_q, H, d_v], lse [S_q, H], attn_sink [H],
// indices [S_q, K], topk_length [S_q]; results dq, dkv, d_attn_sink shaped like q, kv, attn_sink.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "xla/ffi/api/ffi.h"

namespace jax_dsa {

// "" when the buffers follow the contract, else what is wrong (naming the buffer).
template <typename Q, typename KV, typename O, typename L, typename S, typename I, typename T,
          typename DQ, typename DKV, typename DS>
std::string BackwardShapeError(const Q& q, const KV& kv, const O& out, const O& dout, const L& lse,
                               const S& attn_sink, const I& indices, const T& topk_length,
                               const DQ& dq, const DKV& dkv, const DS& d_sink, int64_t d_v) {
  const int64_t s_q = q.dimensions()[0], h = q.dimensions()[1], d = q.dimensions()[2];
  const int64_t s_kv = kv.dimensions()[0], k = indices.dimensions()[1];
  const std::string dv = std::to_string(d_v);
  if (!Shaped(kv, {s_kv, d}))
    return "kv " + Dims(kv.dimensions()) + " must be [S_kv, D_qk=" + std::to_string(d) + "]";
  if (!Shaped(out, {s_q, h, d_v})) return "out " + Dims(out.dimensions()) + " must be [S_q, H, " + dv + "]";
  if (!Shaped(dout, {s_q, h, d_v})) return "dout " + Dims(dout.dimensions()) + " must be [S_q, H, " + dv + "]";
  if (!Shaped(lse, {s_q, h})) return "lse " + Dims(lse.dimensions()) + " must be [S_q, H]";
  if (!Shaped(attn_sink, {h})) return "attn_sink " + Dims(attn_sink.dimensions()) + " must be [H]";
  if (!Shaped(indices, {s_q, k})) return "indices " + Dims(indices.dimensions()) + " must be [S_q, K]";
  if (!Shaped(topk_length, {s_q}))
    return "topk_length " + Dims(topk_length.dimensions()) + " must be [S_q]";
  if (!Shaped(dq, {s_q, h, d}) || !Shaped(dkv, {s_kv, d}) || !Shaped(d_sink, {h}))
    return "results dq, dkv, d_attn_sink must be shaped like q, kv, attn_sink";
  return "";
}

}  // namespace jax_dsa

// The contract's FFI binding (operands, results, sm_scale), in the order above; a handler adds
// its own attributes after it. (A macro: the template arguments' commas would split
// XLA_FFI_DEFINE_HANDLER_SYMBOL's.)
#define JAX_DSA_SPARSE_MLA_BWD_CONTRACT_BINDING                        \
  ::xla::ffi::Ffi::Bind()                                              \
      .Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16, 3>>() /* q */          \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16, 2>>() /* kv */         \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16, 3>>() /* out */        \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16, 3>>() /* dout */       \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32, 2>>()  /* lse */        \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32, 1>>()  /* attn_sink */  \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32, 2>>()  /* indices */    \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32, 1>>()  /* topk_length */\
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16, 3>>() /* dq */         \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16, 2>>() /* dkv */        \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32, 1>>()  /* d_attn_sink */\
      .Ret<::xla::ffi::Buffer<::xla::ffi::U8, 1>>()   /* workspace */  \
      .Attr<float>("sm_scale")
