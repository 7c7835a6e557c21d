// The lightning indexer's top-k on SM90 (plain CUDA C++, nvcc sm_90a): the launch interface of
// kernels.cu, no XLA (the FFI handlers: handler.cc).
//
// Contract (jax_dsa/ops/indexer/topk/cuda.py prepares it; the "xla" implementation defines it):
// per batch element, scores I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) (bf16 q, k; fp32
// tensor-core accumulation; fp32 w and head sum), key s visible to query t iff
// kv_pos[s] <= q_pos[t] and kv_seg[s] == q_seg[t]; per row the topk visible keys by descending
// score, exact ties to the lower key index, -0.0 == +0.0, visible scores clamped to >= -FLT_MAX,
// -1 past the visible count.
//
// Work per batch element and chunk of query rows (a [chunk_rows, ld] fp32 score buffer in the
// workspace, never [S_q, S_kv] at once): (1) per 64-key tile min position and segment range;
// (2) the score kernel: wgmma m64n128k16 bf16 (K Q^T, 64 keys x 4 queries' 32 heads, or 2
// queries' 64), a producer warpgroup streaming 64-key tiles through shared memory by cp.async,
// relu + weighted head sum in registers, -inf for invisible keys; the key tiles that no query of
// a CTA can see are skipped and the row's scanned range [lo, hi) is recorded; (3) the top-k
// kernel: one 256-thread CTA per row,
// radix select on order-preserving uint32 keys (up to 8192 keys the row cached in shared memory,
// 8 bits a pass; past that two sweeps over the row: a 13-bit histogram of the keys above a floor
// sampled from the row, then the threshold bin's keys selected in shared memory), lowest-index
// tie rule by an ordered prefix count, the selected keys collected in index order and sorted by a
// stable block radix sort (CUB) on their keys; optionally the selected keys' scores beside their
// indices.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_dsa {
namespace indexer {

constexpr int kTopkHeadDim = 128;     // index_head_dim compiled
constexpr int kTopkMaxK = 2048;       // topk at most
constexpr int64_t kTopkMaxSkv = int64_t(1) << 21;
constexpr int kTopkKeyTile = 64;      // keys per score tile (the workspace row stride's multiple)
constexpr int kTopkRowTile = 8;       // a chunk's rows are best a multiple of this

// Heads the kernels take (the glue pads index heads with zero q and zero weight).
inline bool TopkHeadsSupported(int64_t h) { return h == 32 || h == 64; }

// Bytes of the workspace for S_kv keys and chunk_rows query rows per chunk:
// scores [chunk_rows, ld] fp32 (ld = S_kv rounded up to 64), row ranges [chunk_rows] int2,
// key-tile stats [ld / 64] int4, each section 256-byte aligned.
inline size_t TopkRowStride(int64_t s_kv) {
  return size_t((s_kv + kTopkKeyTile - 1) / kTopkKeyTile) * kTopkKeyTile;
}
inline size_t TopkAlign(size_t x) { return (x + 255) / 256 * 256; }
inline size_t TopkWorkspaceBytes(int64_t s_kv, int64_t chunk_rows) {
  const size_t ld = TopkRowStride(s_kv);
  return TopkAlign(size_t(chunk_rows) * ld * 4) + TopkAlign(size_t(chunk_rows) * 8) +
         TopkAlign(ld / kTopkKeyTile * 16);
}

struct TopkLaunch {
  const void* q;        // [nb, s_q, heads, 128] bf16
  const void* k;        // [nb, s_kv, 128] bf16
  const float* w;       // [nb, s_q, heads]
  const int32_t* q_pos; // [nb, s_q]
  const int32_t* kv_pos;
  const int32_t* q_seg;
  const int32_t* kv_seg;
  int32_t* out;         // [nb, s_q, topk]
  void* workspace;      // TopkWorkspaceBytes(s_kv, chunk_rows)
  int64_t nb, s_q, s_kv, heads, topk, chunk_rows;
  cudaStream_t stream;
  // Optional [nb, s_q, topk] fp32: each selected key's score (-inf past the visible count).
  float* out_scores = nullptr;
  // The stages run: 0 (what the handler runs) both; for the self-test's kernel timings
  // (ffi/cuda/selftest/topk_selftest.cu --bench) 1, the score kernel alone (out not written), or
  // 2, the top-k kernel alone, on the workspace's scores and ranges from an earlier call of the
  // same shapes.
  int stages = 0;
};

// The index scores' log-sum-exp over each row's visible keys (the dense indexer KL loss's
// normaliser), lse[t] = log sum_s exp(I[t, s]) with I as above (-inf for a row without visible
// keys): the score kernel with no scores stored, each CTA's running (max, sum) per row merged by a
// second kernel. Uses a's inputs, nb, s_q, s_kv, heads and stream; a.workspace holds
// IndexLseWorkspaceBytes(s_kv, s_q) bytes: partials [IndexLsePartials(s_q)] float2, row ranges
// [s_q] int2, key-tile stats [ld / 64] int4 (each section 256-byte aligned). lse: [nb, s_q] fp32.
inline int64_t IndexLsePartials(int64_t s_q) { return s_q > 8192 ? s_q : 8192; }
inline size_t IndexLseWorkspaceBytes(int64_t s_kv, int64_t s_q) {
  return TopkAlign(size_t(IndexLsePartials(s_q)) * 8) + TopkAlign(size_t(s_q) * 8) +
         TopkAlign(TopkRowStride(s_kv) / kTopkKeyTile * 16);
}
cudaError_t LaunchIndexLse(const TopkLaunch& a, float* lse, const char** what);

// Raises the kernels' shared-memory limits on the current device (idempotent, per device).
cudaError_t TopkPrepare();
// Enqueues the whole computation on a.stream (no allocation, no synchronisation). `what` names
// the failing step.
cudaError_t LaunchTopk(const TopkLaunch& a, const char** what);

}  // namespace indexer
}  // namespace jax_dsa
