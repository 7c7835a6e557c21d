// XLA FFI handlers of the grouped matmul (targets jax_dsa_grouped_matmul_{fwd,dgrad,wgrad}_cuda,
// registered by ffi/cuda/module_cuda.cc) over the SM90 kernels of grouped_matmul.h, enqueued on
// XLA's stream with the workspace as an explicit output (no allocation, no synchronisation).
//
//   fwd   (lhs [M, K], rhs [G, K, N], group_sizes [G]) -> (out [M, N], workspace)
//   dgrad (d_out [M, N], rhs [G, K, N], group_sizes [G]) -> (d_lhs [M, K], workspace)
//   wgrad (lhs [M, K], d_out [M, N], group_sizes [G]) -> (d_rhs [G, K, N], workspace)
//
// The Python glue (jax_dsa/ops/grouped_matmul/cuda.py) maps the op's layouts onto these by role.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/grouped_matmul/grouped_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

ffi::Error Invalid(const char* which, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string("jax_dsa grouped_matmul cuda ") + which + ": " + msg);
}

const __nv_bfloat16* In(ffi::Buffer<ffi::BF16>& b) {
  return reinterpret_cast<const __nv_bfloat16*>(b.untyped_data());
}

__nv_bfloat16* Out(ffi::Result<ffi::Buffer<ffi::BF16>>& b) {
  return reinterpret_cast<__nv_bfloat16*>(b->untyped_data());
}

ffi::Error Done(const char* which, const char* err) {
  if (err == nullptr) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_dsa grouped_matmul cuda ") + which + ": " + err);
}

// Shared checks: a [rows, cols] 2-D buffer, group sizes [G], a large enough workspace.
ffi::Error CheckCommon(const char* which, ffi::Buffer<ffi::S32>& sizes, int64_t g,
                       ffi::Result<ffi::Buffer<ffi::U8>>& ws) {
  if (sizes.dimensions().size() != 1 || sizes.dimensions()[0] != g)
    return Invalid(which, "group_sizes " + Dims(sizes.dimensions()) + " must be [G=" +
                              std::to_string(g) + "]");
  if (g < 1 || g > gmm::kMaxGroups)
    return Invalid(which, "G=" + std::to_string(g) + " must be in [1, " +
                              std::to_string(gmm::kMaxGroups) + "]");
  const size_t need = gmm::GroupedMatmulWorkspaceBytes(static_cast<int>(g));
  if (ws->size_bytes() < need)
    return Invalid(which, "workspace of " + std::to_string(ws->size_bytes()) + " bytes, needs " +
                              std::to_string(need));
  return ffi::Error::Success();
}

bool Is2D(ffi::Buffer<ffi::BF16>& b, int64_t rows, int64_t cols) {
  auto d = b.dimensions();
  return d.size() == 2 && d[0] == rows && d[1] == cols;
}

ffi::Error Fwd(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::BF16> rhs,
               ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::BF16>> out,
               ffi::Result<ffi::Buffer<ffi::U8>> ws) {
  const char* which = "forward";
  if (lhs.dimensions().size() != 2 || rhs.dimensions().size() != 3)
    return Invalid(which, "lhs " + Dims(lhs.dimensions()) + " must be [M, K] and rhs " +
                              Dims(rhs.dimensions()) + " [G, K, N]");
  const int64_t m = lhs.dimensions()[0], k = lhs.dimensions()[1];
  const int64_t g = rhs.dimensions()[0], n = rhs.dimensions()[2];
  if (rhs.dimensions()[1] != k) return Invalid(which, "rhs " + Dims(rhs.dimensions()) + " must be [G, K=" + std::to_string(k) + ", N]");
  if (auto e = CheckCommon(which, sizes, g, ws); e.failure()) return e;
  auto d = out->dimensions();
  if (d.size() != 2 || d[0] != m || d[1] != n) return Invalid(which, "out " + Dims(d) + " must be [M, N]");
  return Done(which, gmm::GroupedMatmulFwd(In(lhs), In(rhs), sizes.typed_data(), Out(out), m, k, n,
                                           static_cast<int>(g), ws->untyped_data(),
                                           ws->size_bytes(), stream));
}

ffi::Error Dgrad(cudaStream_t stream, ffi::Buffer<ffi::BF16> d_out, ffi::Buffer<ffi::BF16> rhs,
                 ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::BF16>> d_lhs,
                 ffi::Result<ffi::Buffer<ffi::U8>> ws) {
  const char* which = "input gradient";
  if (d_out.dimensions().size() != 2 || rhs.dimensions().size() != 3)
    return Invalid(which, "d_out " + Dims(d_out.dimensions()) + " must be [M, N] and rhs " +
                              Dims(rhs.dimensions()) + " [G, K, N]");
  const int64_t m = d_out.dimensions()[0], n = d_out.dimensions()[1];
  const int64_t g = rhs.dimensions()[0], k = rhs.dimensions()[1];
  if (rhs.dimensions()[2] != n) return Invalid(which, "rhs " + Dims(rhs.dimensions()) + " must be [G, K, N=" + std::to_string(n) + "]");
  if (auto e = CheckCommon(which, sizes, g, ws); e.failure()) return e;
  auto d = d_lhs->dimensions();
  if (d.size() != 2 || d[0] != m || d[1] != k) return Invalid(which, "d_lhs " + Dims(d) + " must be [M, K]");
  return Done(which, gmm::GroupedMatmulDgrad(In(d_out), In(rhs), sizes.typed_data(), Out(d_lhs), m,
                                             k, n, static_cast<int>(g), ws->untyped_data(),
                                             ws->size_bytes(), stream));
}

ffi::Error Wgrad(cudaStream_t stream, ffi::Buffer<ffi::BF16> lhs, ffi::Buffer<ffi::BF16> d_out,
                 ffi::Buffer<ffi::S32> sizes, ffi::Result<ffi::Buffer<ffi::BF16>> d_rhs,
                 ffi::Result<ffi::Buffer<ffi::U8>> ws) {
  const char* which = "weight gradient";
  if (lhs.dimensions().size() != 2 || d_out.dimensions().size() != 2 ||
      lhs.dimensions()[0] != d_out.dimensions()[0])
    return Invalid(which, "lhs " + Dims(lhs.dimensions()) + " and d_out " + Dims(d_out.dimensions()) +
                              " must be [M, K] and [M, N]");
  const int64_t m = lhs.dimensions()[0], k = lhs.dimensions()[1], n = d_out.dimensions()[1];
  auto d = d_rhs->dimensions();
  if (d.size() != 3 || d[1] != k || d[2] != n) return Invalid(which, "d_rhs " + Dims(d) + " must be [G, K, N]");
  const int64_t g = d[0];
  if (auto e = CheckCommon(which, sizes, g, ws); e.failure()) return e;
  return Done(which, gmm::GroupedMatmulWgrad(In(lhs), In(d_out), sizes.typed_data(), Out(d_rhs), m,
                                             k, n, static_cast<int>(g), ws->untyped_data(),
                                             ws->size_bytes(), stream));
}

}  // namespace
}  // namespace jax_dsa

#define JAX_DSA_GMM_BINDING                                          \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                      \
      .Arg<ffi::Buffer<ffi::BF16>>()                                 \
      .Arg<ffi::Buffer<ffi::BF16>>()                                 \
      .Arg<ffi::Buffer<ffi::S32>>()  /* group_sizes */               \
      .Ret<ffi::Buffer<ffi::BF16>>()                                 \
      .Ret<ffi::Buffer<ffi::U8>>()   /* workspace */

// Launches on XLA's stream only (TMA descriptors encoded on the host at each call): capture-safe.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaGroupedMatmulFwdCuda, jax_dsa::Fwd, JAX_DSA_GMM_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaGroupedMatmulDgradCuda, jax_dsa::Dgrad, JAX_DSA_GMM_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaGroupedMatmulWgradCuda, jax_dsa::Wgrad, JAX_DSA_GMM_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
