// jax_dsa._cuda_indexer: the lightning indexer's SM90 CUDA kernels as XLA FFI targets (API 0.4).
// Loaded by jax_dsa/_native.py, which registers every entry of registrations() for "CUDA".

#include <nanobind/nanobind.h>

#include <cstdint>

#include "indexer_topk.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerTopkCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerTopkCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerTopkCudaInit);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerLseCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerLseCudaNoGraph);
// The sparse KL loss (kl_loss_ffi.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlFwdCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlBwdCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlDenseBwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerKlDenseBwdCudaNoGraph);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerScoreCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerScoreCudaNoGraph);
// DeepSeek V4's KL loss: the forward with given denominators (kl_loss_ffi.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerV4KlFwdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxDsaIndexerV4KlFwdCudaNoGraph);

NB_MODULE(_cuda_indexer, m) {
  m.doc() = "jax_dsa lightning indexer on SM90: top-k (XLA FFI API 0.4).";
  m.def("registrations", [](bool graphs) {
    nb::dict d;
    nb::dict topk;
    topk["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaIndexerTopkCudaInit));
    topk["execute"] = nb::capsule(
        reinterpret_cast<void*>(graphs ? JaxDsaIndexerTopkCuda : JaxDsaIndexerTopkCudaNoGraph));
    d["jax_dsa_indexer_topk_cuda"] = topk;
    nb::dict lse;
    lse["initialize"] = nb::capsule(reinterpret_cast<void*>(JaxDsaIndexerTopkCudaInit));
    lse["execute"] = nb::capsule(
        reinterpret_cast<void*>(graphs ? JaxDsaIndexerLseCuda : JaxDsaIndexerLseCudaNoGraph));
    d["jax_dsa_indexer_lse_cuda"] = lse;
    nb::dict kl_fwd, kl_bwd;
    kl_fwd["execute"] = nb::capsule(
        reinterpret_cast<void*>(graphs ? JaxDsaIndexerKlFwdCuda : JaxDsaIndexerKlFwdCudaNoGraph));
    kl_bwd["execute"] = nb::capsule(
        reinterpret_cast<void*>(graphs ? JaxDsaIndexerKlBwdCuda : JaxDsaIndexerKlBwdCudaNoGraph));
    d["jax_dsa_indexer_kl_fwd_cuda"] = kl_fwd;
    d["jax_dsa_indexer_kl_bwd_cuda"] = kl_bwd;
    nb::dict kl_dense_bwd;
    kl_dense_bwd["execute"] = nb::capsule(reinterpret_cast<void*>(
        graphs ? JaxDsaIndexerKlDenseBwdCuda : JaxDsaIndexerKlDenseBwdCudaNoGraph));
    d["jax_dsa_indexer_kl_dense_bwd_cuda"] = kl_dense_bwd;
    nb::dict score;
    score["execute"] = nb::capsule(
        reinterpret_cast<void*>(graphs ? JaxDsaIndexerScoreCuda : JaxDsaIndexerScoreCudaNoGraph));
    d["jax_dsa_indexer_score_cuda"] = score;
    nb::dict v4_kl_fwd;
    v4_kl_fwd["execute"] = nb::capsule(reinterpret_cast<void*>(
        graphs ? JaxDsaIndexerV4KlFwdCuda : JaxDsaIndexerV4KlFwdCudaNoGraph));
    d["jax_dsa_indexer_v4_kl_fwd_cuda"] = v4_kl_fwd;
    return d;
  }, nb::arg("graphs") = true);
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
