// jax_dsa._cuda: the SM90 sparse MLA kernels as a nanobind module (XLA FFI API 0.4).
// jax_dsa/_native.py registers every entry of registrations() for the platform "CUDA".
//   jax_dsa_sparse_mla_fwd_cuda, jax_dsa_dense_mla_fwd_cuda, jax_dsa_sparse_mla_target_cuda:
//       the own forward kernel (sparse_mla_fwd/handler.cc)
//   jax_dsa_dsa_bwd_cuda: the cuDNN frontend's DSA backward (dsa_bwd/handler.cc)
//   jax_dsa_sparse_mla_bwd_cuda: jax_dsa's own backward, with a deterministic mode
//       (sparse_mla_bwd/handler.cc)
//   jax_dsa_compact_slots_cuda: the backward glue's slot compaction (slot_compact/handler.cc)
//   jax_dsa_grouped_matmul_{fwd,dgrad,wgrad}_cuda: the routed experts' grouped GEMMs
//       (grouped_matmul/handler.cc)
// Every execute handler carries the command-buffer trait (capture-safe: launches and async
// memsets on XLA's stream, modules loaded in the initialize stage).

#include <nanobind/nanobind.h>

#include "cuda/dsa_bwd/launch.h"
#include "cuda/grouped_matmul/grouped_matmul.h"
#include "cuda/sparse_mla_bwd/launch.h"
#include "cuda/sparse_mla_fwd/variants.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdCudaInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDenseMlaFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaTargetCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDsaBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaDsaBwdCudaInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaCompactSlotsCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaGroupedMatmulFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaGroupedMatmulDgradCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaGroupedMatmulWgradCuda);

namespace nb = nanobind;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// {"initialize": init, "execute": execute}: a target with an initialize stage.
nb::dict Staged(XLA_FFI_Error* (*init)(XLA_FFI_CallFrame*),
                XLA_FFI_Error* (*execute)(XLA_FFI_CallFrame*)) {
  nb::dict d;
  d["initialize"] = Capsule(init);
  d["execute"] = Capsule(execute);
  return d;
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jax_dsa CUDA sparse MLA: own SM90 forward and the cuDNN frontend's SM90 DSA backward (AOT; XLA FFI API 0.4).";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_dsa_sparse_mla_fwd_cuda"] = Staged(JaxDsaSparseMlaFwdCudaInit, JaxDsaSparseMlaFwdCuda);
    d["jax_dsa_dense_mla_fwd_cuda"] = Staged(JaxDsaSparseMlaFwdCudaInit, JaxDsaDenseMlaFwdCuda);
    d["jax_dsa_sparse_mla_target_cuda"] = Staged(JaxDsaSparseMlaFwdCudaInit, JaxDsaSparseMlaTargetCuda);
    d["jax_dsa_dsa_bwd_cuda"] = Staged(JaxDsaDsaBwdCudaInit, JaxDsaDsaBwdCuda);
    d["jax_dsa_sparse_mla_bwd_cuda"] = Capsule(JaxDsaSparseMlaBwdCuda);
    d["jax_dsa_compact_slots_cuda"] = Capsule(JaxDsaCompactSlotsCuda);
    d["jax_dsa_grouped_matmul_fwd_cuda"] = Capsule(JaxDsaGroupedMatmulFwdCuda);
    d["jax_dsa_grouped_matmul_dgrad_cuda"] = Capsule(JaxDsaGroupedMatmulDgradCuda);
    d["jax_dsa_grouped_matmul_wgrad_cuda"] = Capsule(JaxDsaGroupedMatmulWgradCuda);
    return d;
  }, "FFI target name -> handler capsule, or {stage: capsule} for targets with an initialize stage.");
  m.def("grouped_matmul_workspace_bytes", &jax_dsa::gmm::GroupedMatmulWorkspaceBytes,
        nb::arg("num_groups"), "Bytes of the grouped matmul kernels' workspace output.");
  m.def("workspace_bytes", &jax_dsa::WorkspaceBytes, nb::arg("s_q"), nb::arg("s_kv"), nb::arg("h"), nb::arg("d"),
        "Bytes of the backward's workspace output (the frontend's SM90 formula).");
  m.def("sparse_mla_bwd_workspace_bytes",
        [](int64_t s_q, int64_t s_kv, int64_t h, int64_t d, int64_t k, bool deterministic) {
          return jax_dsa::sparse_mla_bwd::SparseMlaBwdWorkspaceBytes(s_q, s_kv, h, d, k, deterministic);
        },
        nb::arg("s_q"), nb::arg("s_kv"), nb::arg("h"), nb::arg("d"), nb::arg("k"), nb::arg("deterministic"),
        "Bytes of the own backward's workspace output (0: unsupported dimensions).");
  m.def("variants", []() {
    nb::list l;
    for (int i = 0; i < jax_dsa::kNumMainKernels; ++i) {
      const auto& k = jax_dsa::kMainKernels[i];
      l.append(nb::make_tuple(k.h, k.d, k.topk));
    }
    return l;
  }, "(H, D_qk, slot bucket) of every compiled main kernel.");
  m.def("compiled_variants", []() {
    nb::dict d, fwd, bwd;
    nb::list fwd_v, dense_v, target_v, main_v, pre_h, post_d;
    for (int i = 0; i < jax_dsa::kNumSparseMlaFwdKernels; ++i) {
      const auto& k = jax_dsa::kSparseMlaFwdKernels[i];
      (k.target ? target_v : k.contiguous ? dense_v : fwd_v).append(nb::make_tuple(k.h, k.d));
    }
    fwd["variants"] = fwd_v;
    fwd["dense_variants"] = dense_v;
    fwd["target_variants"] = target_v;
    fwd["d_v"] = jax_dsa::kSparseMlaFwdDv;
    fwd["k_multiple"] = jax_dsa::kSparseMlaFwdKMultiple;
    for (int i = 0; i < jax_dsa::kNumMainKernels; ++i) {
      const auto& k = jax_dsa::kMainKernels[i];
      main_v.append(nb::make_tuple(k.h, k.d, k.topk));
    }
    for (int i = 0; i < jax_dsa::kNumPreKernels; ++i) pre_h.append(jax_dsa::kPreKernels[i].h);
    for (int i = 0; i < jax_dsa::kNumPostKernels; ++i) post_d.append(jax_dsa::kPostKernels[i].d);
    bwd["variants"] = main_v;
    bwd["pre_heads"] = pre_h;
    bwd["post_d_qk"] = post_d;
    bwd["d_v"] = jax_dsa::kDsaBwdDv;
    d["forward"] = fwd;
    d["backward"] = bwd;
    return d;
  }, "What the dispatch tables hold: forward (H, D_qk) variants (variants: slot lists; "
     "dense_variants: contiguous runs; target_variants: the indexer loss's target over slot "
     "lists), d_v and K multiple; backward (H, D_qk, slot bucket; 0 = any K) main kernels, "
     "pre-pass heads, post-pass D_qk and d_v.");
  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("ARCH") = "sm_90a";
}
