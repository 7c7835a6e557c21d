// XLA FFI handler for the CUDA sparse MLA backward: the cuDNN frontend's SM90 DSA backward
// (nvidia-cudnn-frontend 1.32.0, cudnn/deepseek_sparse_attention/sparse_attention_backward/
// dsa_bwd_sm90.py), compiled ahead of time by ffi/cuda/export/export_dsa_bwd.py and launched here
// with no compiler, no PyTorch and no allocation at run time. Target jax_dsa_dsa_bwd_cuda
// (registered by ffi/cuda/module_cuda.cc).
//
// Contract (the public op's glue in jax_dsa/ops/sparse_mla prepares it): flat tokens, bf16,
// H, D_qk and d_v as compiled (jax_dsa/kernel_spec.py: H 64 or 128, D_qk 512 or 576, d_v 512),
// indices [S_q, K] (K a compiled slot bucket, else the wide variant), valid slots a prefix of length
// topk_length >= 1, lse natural-log and sink-free (+inf for rows without valid slots),
// attn_sink -inf for no sink. The workspace is an output sized by WorkspaceBytes (the
// frontend's flash_attn_bwd_sm90_workspace_size). The benchmarks' raw-pointer entry is in
// ffi/cuda/bench/dsa_bwd_bench.cc (a separate library), not in this module.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/dsa_bwd/launch.h"
#include "cuda/sparse_mla_bwd/contract.h"
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
  const std::string bad = BackwardShapeError(q, kv, out, dout, lse, attn_sink, indices,
                                             topk_length, *dq, *dkv, *d_sink, kDsaBwdDv);
  if (!bad.empty()) return Invalid(bad);
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

}  // namespace
}  // namespace jax_dsa

// Execute is capture-safe (async memsets and kernel launches on XLA's stream, no allocation,
// no synchronisation; modules are loaded in INITIALIZE), so it may join CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaDsaBwdCuda, jax_dsa::Backward,
                              JAX_DSA_SPARSE_MLA_BWD_CONTRACT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaDsaBwdCudaInit, jax_dsa::Initialize,
                              ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());
