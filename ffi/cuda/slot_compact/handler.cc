// XLA FFI handler of the slot compaction (target jax_dsa_compact_slots_cuda, registered by
// ffi/cuda/module_cuda.cc): the sparse MLA backward glue's stable partition of the slot lists
// (jax_dsa/ops/sparse_mla/cuda.py; kernel and contract: kernels.cu, launch.h), enqueued on XLA's
// stream (no allocation, no synchronisation).

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/ffi_shapes.h"
#include "cuda/slot_compact/launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

// (The messages name the backward, whose glue this step is.)
ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_dsa sparse_mla cuda backward: " + msg);
}

// rows [T, K_in] -> [T, K_out], the entries >= 0 first (in their order, or ascending when
// key_bits > 0: launch.h), -1 after (K_out >= K_in: the slot bucket's padding).
ffi::Error CompactSlots(cudaStream_t stream, ffi::Buffer<ffi::S32, 2> rows,
                        ffi::ResultBuffer<ffi::S32, 2> out, int32_t key_bits) {
  const int64_t t = rows.dimensions()[0], k_in = rows.dimensions()[1], k_out = out->dimensions()[1];
  if (out->dimensions()[0] != t || k_out < k_in)
    return Invalid("compacted slots " + Dims(out->dimensions()) + " must be [T, K_out >= " +
                   std::to_string(k_in) + "] for rows " + Dims(rows.dimensions()));
  if (t > INT32_MAX || k_out > INT32_MAX / 2) return Invalid("too many slot rows or slots for 32-bit extents");
  if (key_bits < 0 || key_bits > 32) return Invalid("key_bits " + std::to_string(key_bits) + " must be in [0, 32]");
  cudaError_t e = LaunchCompactSlots(rows.typed_data(), out->typed_data(), t, k_in, k_out, key_bits, stream);
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_dsa sparse_mla cuda backward: compacting the slot lists: ") +
                              cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

}  // namespace
}  // namespace jax_dsa

#define JAX_DSA_COMPACT_BINDING                                      \
  ffi::Ffi::Bind()                                                   \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                      \
      .Arg<ffi::Buffer<ffi::S32, 2>>()   /* rows */                  \
      .Ret<ffi::Buffer<ffi::S32, 2>>()   /* compacted rows */          \
      .Attr<int32_t>("key_bits")         /* 0: stable; > 0: sorted */

// One kernel launch on XLA's stream: capture-safe.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaCompactSlotsCuda, jax_dsa::CompactSlots, JAX_DSA_COMPACT_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
