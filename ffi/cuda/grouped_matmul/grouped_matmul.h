// Grouped (ragged) matrix products for the routed experts of a mixture-of-experts layer, on SM90
// (H100 / H200; built for sm_90a: wgmma, TMA, mbarriers). Plain CUDA C++, no XLA, no Python.
// Issue 46. The three products of training, bf16 in, fp32 accumulation, bf16 out:
//
//   forward  out  [M, N]    = lhs [M, K] . rhs[g] [K, N]        rows of group g use expert g
//   dgrad    d_lhs[M, K]    = d_out [M, N] . rhs[g]^T           same ragged rows, rhs transposed
//   wgrad    d_rhs[g][K, N] = lhs_g^T . d_out_g                 per group, over that group's rows
//
// Layouts: every matrix row-major and dense (leading dimension = its column count):
//   lhs, d_lhs [M, K]; out, d_out [M, N]; rhs, d_rhs [G, K, N] (expert g at offset g*K*N).
// group_sizes: int32 [G] in DEVICE memory. Rows of group g are contiguous and the groups lie back
// to back from row 0: group g holds rows [off[g], off[g+1]).
//
// Offsets are clamped, so that no run-time value can read or write out of bounds:
//   off[0] = 0, off[g+1] = min(M, sum_{i<=g} max(0, group_sizes[i]))   (64-bit sum)
// i.e. a negative size counts as 0 and the groups end at row M (a group past it is cut or empty).
// Rows [off[G], M) of out / d_lhs are written with zeros (as jax.lax.ragged_dot does); d_rhs of a
// group with no rows is zeros.
//
// Requirements (checked; a violation returns an error and launches nothing):
//   K % 64 == 0 and N % 64 == 0 (the op pads or refuses); 1 <= G <= 1024; M >= 0; K, N >= 64;
//   M, K, N < 2^31 and G*K < 2^31; every matrix pointer 16-byte aligned; the workspace
//   GroupedMatmulWorkspaceBytes(G) bytes, 16-byte aligned, device memory, not shared with another
//   launch in flight; the device is SM90 (compute capability 9.0, sm_90a code).
// Each call encodes its TMA descriptors on the host, launches a prep kernel (the clamped offsets
// and tile counts into the workspace) and one persistent kernel on `stream`; it never allocates
// and never synchronises, so it can be captured in a CUDA graph (the descriptors hold the
// pointers: a graph replays with the same buffers).
// Return value: nullptr on success, else a static message (argument errors name the argument;
// launch errors are cudaGetErrorString's text).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jax_dsa {
namespace gmm {

constexpr int kMaxGroups = 1024;

// Bytes of device workspace every entry point needs for `num_groups` groups.
size_t GroupedMatmulWorkspaceBytes(int num_groups);

// out [M, N] = lhs [M, K] . rhs[g] [K, N] by group rows; rows past off[G] are zeros.
const char* GroupedMatmulFwd(const __nv_bfloat16* lhs, const __nv_bfloat16* rhs,
                             const int32_t* group_sizes, __nv_bfloat16* out, int64_t m, int64_t k,
                             int64_t n, int num_groups, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);

// d_lhs [M, K] = d_out [M, N] . rhs[g]^T by group rows; rows past off[G] are zeros.
const char* GroupedMatmulDgrad(const __nv_bfloat16* d_out, const __nv_bfloat16* rhs,
                               const int32_t* group_sizes, __nv_bfloat16* d_lhs, int64_t m,
                               int64_t k, int64_t n, int num_groups, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream);

// d_rhs [G, K, N]: d_rhs[g] = lhs[off[g]:off[g+1]]^T . d_out[off[g]:off[g+1]]; zeros for an
// empty group. Rows past off[G] take part in no group.
const char* GroupedMatmulWgrad(const __nv_bfloat16* lhs, const __nv_bfloat16* d_out,
                               const int32_t* group_sizes, __nv_bfloat16* d_rhs, int64_t m,
                               int64_t k, int64_t n, int num_groups, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream);

#ifdef JAX_DSA_GMM_VARIANTS
// The selftest build only (JAX_DSA_CUDA_SELFTEST; not thread-safe): the kernel variant later calls use.
// 0: 4-stage ring, direct masked stores; 1 (default): 3-stage ring, tile halves stored through
// shared memory by TMA.
void SetVariantForTesting(int variant);
#endif

}  // namespace gmm
}  // namespace jax_dsa
