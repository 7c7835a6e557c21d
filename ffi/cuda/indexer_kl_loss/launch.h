// The indexer KL loss on SM90 (jax_dsa.indexer_kl_loss(..., implementation="cuda"), sparse and
// dense forms, and DeepSeek V4's loss): the launch interface of two CUDA C++ kernels (kernels.cu;
// the XLA FFI handlers: handler.cc), no XLA. The KL algebra on the small [T, K] arrays stays in XLA
// (jax_dsa/ops/indexer/kl_loss/cuda.py, v4_kl_loss/cuda.py); no [T, K, D] gather ever reaches
// HBM.
//
// Kernel A (forward, the "target" kernel; FFI target jax_dsa_indexer_kl_fwd_cuda). Per query row
// t, per 64-head group g of the main attention, a cluster of C = ceil(K / 256) CTAs each takes
// 256 slots: it gathers the slots' kv rows chunk by chunk into shared memory, computes the
// 64 x 256 logits on the tensor cores and keeps them in registers, reduces each head's max and
// sum of exponentials over the row's whole support (through distributed shared memory across
// the cluster) and writes
//     mass[g, t, j]  = sum_{h in group g, h < H} softmax_h(sm_scale * q[t, h] . kv[row_j])[j]
// (0 outside the support; the caller sums the groups, and the head shards under tensor
// parallelism, and divides by the total H). The CTAs of group 0 also gather the index keys and
// write the index score
//     score[t, j] = sum_hi w[t, hi] * relu(iq[t, hi] . ik[row_j])      (-inf outside the support)
// The support of row t (batch element b = t / s_q): slots j < K with 0 <= idx[t, j] < s_kv,
// row_j = b * s_kv + idx[t, j], kv_pos[row_j] <= q_pos[t] and, with segment ids,
// kv_seg[row_j] == q_seg[t]. Duplicate slots count separately.
//
// Kernel A, DeepSeek V4 mode (FwdArgs::lse given; FFI target jax_dsa_indexer_v4_kl_fwd_cuda):
// the per-head denominators are the given lse[t, h] (window + compressed slots + sink), so the
// per-head statistics pass and the cluster's exchange are skipped (one pass, CTAs launched
// without a cluster). For each slot the kernel writes the LOG of the group's target mass,
//     mass[g, t, j]  = log sum_{h in group g, h < H} exp(sm_scale * q[t, h] . kv[row_j] - lse[t, h])
// (-inf outside the support), computed with the slot's max over the group's heads subtracted,
// so a compressed mass that underflows fp32 (heads whose mass sits on the window or the sink)
// stays exact; the caller log-sum-exps the groups (and the head shards) and normalises per row.
// The index score is as above.
//
// Kernel A, score-only (FwdArgs::mass == nullptr; FFI target jax_dsa_indexer_score_cuda): the
// index score alone (head group 0's CTAs, no cluster), for callers that take the target from the
// attention kernels' target mode (jax_dsa_sparse_mla_target_cuda).
//
// Kernel B (backward, jax_dsa_indexer_kl_bwd_cuda). Per query row, slot tiles of 64: recomputes
// s = iq[t] . ik[row_j] (H_I x 64), forms G[hi, j] = dscore[t, j] * w[t, hi] * (s > 0) and writes
//     d_w[t, hi]  = sum_j dscore[t, j] * relu(s[hi, j])
//     d_iq[t, hi] = sum_j G[hi, j] * ik[row_j]                       (registers, no atomics)
//     d_ik[row_j] += sum_hi G[hi, j] * iq[t, hi]                     (fp32: bulk reductions or
//                                                                     vector atomics)
// On wgmma, one warpgroup a row; d_ik gets 512-byte bulk reductions from shared memory at
// H_I <= 32, red.v4 atomics above. The dense form at H_I <= 32 takes two neighbouring rows a
// warpgroup, so that a key shared by both lists gets one d_ik reduction for the two.
// dscore is 0 off the support (the caller's contract); slots with dscore == 0 or an index out of
// [0, s_kv) add nothing. G is rounded to bf16 for the two tensor-core products (as FlashAttention
// rounds dS); everything is accumulated in fp32. d_ik is zeroed by the handler (memset on XLA's
// stream) before the atomics.
//
// Limits (checked by the handlers and by jax_dsa/ops/indexer/kl_loss/cuda.py supported()):
// D_qk a multiple of 32 (512 and 576 are the supported widths), H <= 128 (groups of 64), index
// head dim 128, H_I <= 64, K <= 2048 (8 CTAs per cluster).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dsa {
namespace indexer_kl {

constexpr int kIndexHeadDim = 128;
constexpr int kMaxHeads = 128;       // main heads: up to two 64-head groups
constexpr int kMaxIndexHeads = 64;
constexpr int kSlotsPerCta = 256;
constexpr int kMaxTopk = 8 * kSlotsPerCta;  // 8 CTAs per cluster (the portable maximum)

struct FwdArgs {
  const __nv_bfloat16* q;    // [T, H, D]
  const __nv_bfloat16* kv;   // [NB * s_kv, D]
  const __nv_bfloat16* iq;   // [T, H_I, 128]
  const __nv_bfloat16* ik;   // [NB * s_kv, 128]
  const float* w;            // [T, H_I]
  const int32_t* idx;        // [T, K]
  const int32_t* q_pos;      // [T]
  const int32_t* kv_pos;     // [NB * s_kv]
  const int32_t* q_seg;      // [T] or nullptr (no segment ids)
  const int32_t* kv_seg;     // [NB * s_kv] or nullptr
  float* mass;               // [ceil(H / 64), T, K], or nullptr: the score alone
  float* score;              // [T, K]
  int64_t t, h, d, h_i, k, s_q, s_kv;
  float sm_scale;
  // DeepSeek V4 (kernel A's given-denominator mode; nullptr: V3.2's per-head softmax):
  const float* lse = nullptr;  // [T, H] natural-log softmax denominators of the main attention
};

struct BwdArgs {
  const __nv_bfloat16* iq;   // [T, H_I, 128]
  const __nv_bfloat16* ik;   // [NB * s_kv, 128]
  const float* w;            // [T, H_I]
  const int32_t* idx;        // [T, K]
  const float* dscore;       // [T, K], 0 off the support
  float* d_iq;               // [T, H_I, 128]
  float* d_ik;               // [NB * s_kv, 128] (zeroed here)
  float* d_w;                // [T, H_I]
  int64_t t, h_i, k, s_q, s_kv;
  // The dense form (the warm-up stage's chunks; dscore == nullptr): dscore is formed in the kernel,
  //     dscore[t, j] = exp(I[t, j] - index_lse[t]) - target[t, j]   on every valid slot,
  // with I = sum_hi w * relu(iq . ik[row_j]) recomputed from the products of (1), and I is written
  // to score (-inf on invalid slots). The caller lists only visible keys.
  const float* index_lse = nullptr;  // [T] log sum over the row's visible keys of exp(I)
  const float* target = nullptr;     // [T, K] the target's probability of each slot
  float* score = nullptr;            // [T, K]
  // The deterministic mode (nullptr: off): d_ik is summed as 64-bit fixed point in d_ik_fixed
  // [NB * s_kv, 128] (zeroed here; the handler's workspace), each term x added as
  // round(x * *fixed_scale), then d_ik = d_ik_fixed / *fixed_scale. The caller picks the scale, a
  // power of two, so that no partial sum of finite terms reaches 2^63
  // (jax_dsa/ops/indexer/kl_loss/cuda.py). A row given a NaN or inf term is flagged in
  // d_ik_nonfinite [NB * s_kv] (zeroed here) and comes out NaN.
  unsigned long long* d_ik_fixed = nullptr;
  unsigned* d_ik_nonfinite = nullptr;
  const float* fixed_scale = nullptr;  // [1], device memory
  // The struct is 160 bytes. NVVM compiles a parameter struct of at most 128 bytes differently
  // (its fields loaded into registers up front), which changes kernel B's generated code: kernel
  // B was measured with more than 128.
};

// Why the arguments cannot be launched (nullptr when they can): the static limits above.
const char* FwdUnsupported(const FwdArgs& a);
const char* BwdUnsupported(const BwdArgs& a);

// Launch on `stream` (no allocation, no synchronisation). Return the launch error, if any.
cudaError_t LaunchFwd(const FwdArgs& a, cudaStream_t stream);
cudaError_t LaunchBwd(const BwdArgs& a, cudaStream_t stream);

}  // namespace indexer_kl
}  // namespace jax_dsa
