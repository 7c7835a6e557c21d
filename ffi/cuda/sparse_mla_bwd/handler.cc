// XLA FFI handler of jax_dsa's own SM90 sparse MLA backward (kernels and contract: kernels.cu,
// launch.h). Target jax_dsa_sparse_mla_bwd_cuda (registered by ffi/cuda/module_cuda.cc), the
// same operands and results as the cuDNN backward's jax_dsa_dsa_bwd_cuda (dsa_bwd/handler.cc),
// plus the attribute `deterministic` (bitwise reproducible dkv). The workspace is an output of
// SparseMlaBwdWorkspaceBytes bytes. Launches and async memsets on XLA's stream only.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/sparse_mla_bwd/contract.h"
#include "cuda/sparse_mla_bwd/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace sparse_mla_bwd {
namespace {

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_dsa sparse_mla cuda backward (own kernel): " + msg);
}

ffi::Error Backward(cudaStream_t stream, ffi::Buffer<ffi::BF16, 3> q, ffi::Buffer<ffi::BF16, 2> kv,
                    ffi::Buffer<ffi::BF16, 3> out, ffi::Buffer<ffi::BF16, 3> dout,
                    ffi::Buffer<ffi::F32, 2> lse, ffi::Buffer<ffi::F32, 1> attn_sink,
                    ffi::Buffer<ffi::S32, 2> indices, ffi::Buffer<ffi::S32, 1> topk_length,
                    ffi::ResultBuffer<ffi::BF16, 3> dq, ffi::ResultBuffer<ffi::BF16, 2> dkv,
                    ffi::ResultBuffer<ffi::F32, 1> d_sink, ffi::ResultBuffer<ffi::U8, 1> workspace,
                    float sm_scale, bool deterministic) {
  const int64_t s_q = q.dimensions()[0], h = q.dimensions()[1], d = q.dimensions()[2];
  const int64_t s_kv = kv.dimensions()[0], k = indices.dimensions()[1];
  const std::string bad = BackwardShapeError(q, kv, out, dout, lse, attn_sink, indices,
                                             topk_length, *dq, *dkv, *d_sink, kDv);
  if (!bad.empty()) return Invalid(bad);
  const size_t need = SparseMlaBwdWorkspaceBytes(s_q, s_kv, h, d, k, deterministic);
  if (need == 0)
    return Invalid("unsupported call: H " + std::to_string(h) + " (64 or 128), D_qk " +
                   std::to_string(d) + " (512 or 576), S_q " + std::to_string(s_q) + ", S_kv " +
                   std::to_string(s_kv) + ", K " + std::to_string(k) + " (each >= 1)");
  if (size_t(workspace->element_count()) < need)
    return Invalid("workspace has " + std::to_string(workspace->element_count()) + " bytes, needs " +
                   std::to_string(need));
  SparseMlaBwdParams p;
  p.q = q.untyped_data();
  p.kv = kv.untyped_data();
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.attn_sink = attn_sink.typed_data();
  p.indices = indices.typed_data();
  p.topk_length = topk_length.typed_data();
  p.dq = dq->untyped_data();
  p.dkv = dkv->untyped_data();
  p.d_sink = d_sink->typed_data();
  p.workspace = workspace->untyped_data();
  p.workspace_bytes = size_t(workspace->element_count());
  p.s_q = s_q;
  p.s_kv = s_kv;
  p.h = h;
  p.d = d;
  p.k = k;
  p.sm_scale = sm_scale;
  p.deterministic = deterministic;
  const cudaError_t e = LaunchSparseMlaBwd(p, stream);
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_dsa sparse_mla cuda backward (own kernel): ") +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace
}  // namespace sparse_mla_bwd
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdCuda, jax_dsa::sparse_mla_bwd::Backward,
                              JAX_DSA_SPARSE_MLA_BWD_CONTRACT_BINDING.Attr<bool>("deterministic"),
                              {ffi::Traits::kCmdBufferCompatible});
