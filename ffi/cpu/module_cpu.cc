// jax_dsa._cpu: the host handlers as a nanobind module (XLA FFI API 0.4). jax_dsa/_native.py
// registers every entry of registrations() for the platform "cpu", and cuda_on_host() under the
// names of the CUDA modules' targets.

#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cpu/sparse_mla/handler.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Registered on the host under the CUDA targets' names: a computation that used
// implementation="cuda" but was placed on the CPU fails with this message instead of
// "no FFI handler registered".
static ffi::Error CudaOnHost(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return ffi::Error::InvalidArgument(
      "jax_dsa: an op called with implementation='cuda' needs an SM90 GPU (H100/H200), but "
      "this computation runs on the host; use implementation=None or 'xla' there");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaCudaOnHost, CudaOnHost,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

namespace nb = nanobind;

NB_MODULE(_cpu, m) {
  m.doc() = "jax_dsa host sparse MLA handlers (XLA FFI, API 0.4).";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_dsa_sparse_mla_fwd_cpu"] = nb::capsule(reinterpret_cast<void*>(JaxDsaSparseMlaFwdCpu));
    d["jax_dsa_sparse_mla_bwd_cpu"] = nb::capsule(reinterpret_cast<void*>(JaxDsaSparseMlaBwdCpu));
    return d;
  });
  m.def("cuda_on_host", []() {
    return nb::capsule(reinterpret_cast<void*>(JaxDsaCudaOnHost));
  });
  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.def("kernel_isa", []() { return std::string(jax_dsa::KernelIsa()); },
        "Instruction set of the row kernels the handlers run: 'avx2+fma' or 'baseline'.");
  m.def("use_kernel_isa", [](const std::string& name) {
    if (!jax_dsa::UseKernelIsa(name))
      throw nb::value_error(("use_kernel_isa: expected 'native' or 'baseline', got '" + name + "'").c_str());
    return std::string(jax_dsa::KernelIsa());
  }, nb::arg("name"),
        "Selects the row kernels for every later call in this process: 'native' (the default: "
        "AVX2+FMA when this CPU has them, else the baseline) or 'baseline' (the same math without "
        "AVX2, for tests). Returns kernel_isa().");
}
