// jax_dsa._cuda_indexer: the lightning indexer's SM90 CUDA kernels as a nanobind module (XLA FFI
// API 0.4). jax_dsa/_native.py registers every entry of registrations() for the platform "CUDA".
//   jax_dsa_indexer_topk_cuda, jax_dsa_indexer_lse_cuda: the scores' top-k and log-sum-exp
//       (indexer_topk/handler.cc)
//   jax_dsa_indexer_kl_fwd_cuda, jax_dsa_indexer_score_cuda, jax_dsa_indexer_v4_kl_fwd_cuda,
//   jax_dsa_indexer_kl_bwd_cuda, jax_dsa_indexer_kl_dense_bwd_cuda (and their _det_ twins, the
//       deterministic mode): the KL loss
//       (indexer_kl_loss/handler.cc)
// Every execute handler carries the command-buffer trait (kernel launches and async memsets on
// XLA's stream only).

#include <nanobind/nanobind.h>

#include <cstdint>

#include "cuda/indexer_topk/launch.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerTopkCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerTopkCudaInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerLseCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerScoreCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerV4KlFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlDenseBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlDetBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlDetDenseBwdCuda);

namespace nb = nanobind;

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*handler)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// {"initialize": init, "execute": execute}, or {"execute": execute} without init.
nb::dict Staged(XLA_FFI_Error* (*init)(XLA_FFI_CallFrame*),
                XLA_FFI_Error* (*execute)(XLA_FFI_CallFrame*)) {
  nb::dict d;
  if (init) d["initialize"] = Capsule(init);
  d["execute"] = Capsule(execute);
  return d;
}

}  // namespace

NB_MODULE(_cuda_indexer, m) {
  m.doc() = "jax_dsa lightning indexer on SM90: top-k and KL loss (XLA FFI API 0.4).";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_dsa_indexer_topk_cuda"] = Staged(JaxDsaIndexerTopkCudaInit, JaxDsaIndexerTopkCuda);
    d["jax_dsa_indexer_lse_cuda"] = Staged(JaxDsaIndexerTopkCudaInit, JaxDsaIndexerLseCuda);
    d["jax_dsa_indexer_kl_fwd_cuda"] = Staged(nullptr, JaxDsaIndexerKlFwdCuda);
    d["jax_dsa_indexer_kl_bwd_cuda"] = Staged(nullptr, JaxDsaIndexerKlBwdCuda);
    d["jax_dsa_indexer_kl_dense_bwd_cuda"] = Staged(nullptr, JaxDsaIndexerKlDenseBwdCuda);
    d["jax_dsa_indexer_kl_bwd_det_cuda"] = Staged(nullptr, JaxDsaIndexerKlDetBwdCuda);
    d["jax_dsa_indexer_kl_dense_bwd_det_cuda"] = Staged(nullptr, JaxDsaIndexerKlDetDenseBwdCuda);
    d["jax_dsa_indexer_score_cuda"] = Staged(nullptr, JaxDsaIndexerScoreCuda);
    d["jax_dsa_indexer_v4_kl_fwd_cuda"] = Staged(nullptr, JaxDsaIndexerV4KlFwdCuda);
    return d;
  }, "FFI target name -> {stage: handler capsule}.");
  m.def("topk_workspace_bytes", [](int64_t s_kv, int64_t chunk_rows) {
    return jax_dsa::indexer::TopkWorkspaceBytes(s_kv, chunk_rows);
  }, nb::arg("s_kv"), nb::arg("chunk_rows"),
        "Bytes of indexer_topk's workspace result for S_kv keys and chunk_rows rows a chunk.");
  m.def("index_lse_workspace_bytes", [](int64_t s_kv, int64_t s_q) {
    return jax_dsa::indexer::IndexLseWorkspaceBytes(s_kv, s_q);
  }, nb::arg("s_kv"), nb::arg("s_q"),
        "Bytes of the index log-sum-exp's workspace result for S_kv keys and S_q rows.");
  m.def("topk_limits", []() {
    nb::dict d;
    d["head_dim"] = jax_dsa::indexer::kTopkHeadDim;
    d["heads"] = nb::make_tuple(32, 64);
    d["max_topk"] = jax_dsa::indexer::kTopkMaxK;
    d["max_s_kv"] = jax_dsa::indexer::kTopkMaxSkv;
    d["key_tile"] = jax_dsa::indexer::kTopkKeyTile;
    d["row_tile"] = jax_dsa::indexer::kTopkRowTile;
    return d;
  }, "What the compiled top-k kernels take.");
  m.attr("FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
