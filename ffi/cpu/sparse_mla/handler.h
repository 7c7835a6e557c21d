// The host sparse MLA handlers (handler.cc): their XLA FFI symbols and the choice of row kernels,
// for the module definition (ffi/cpu/module_cpu.cc).
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"

// jax_dsa_sparse_mla_fwd_cpu and jax_dsa_sparse_mla_bwd_cpu.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdCpu);

namespace jax_dsa {

// The instruction set of the row kernels the handlers run: "avx2+fma" or "baseline".
const char* KernelIsa();

// Which row kernels the handlers run from now on: "native" (the default: AVX2+FMA when CPUID
// reports them, else the baseline) or "baseline" (x86-64 without AVX2; the same math, for tests
// on machines that have AVX2). Returns false for any other name.
bool UseKernelIsa(const std::string& name);

}  // namespace jax_dsa
