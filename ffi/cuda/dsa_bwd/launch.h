// The SM90 DSA backward on raw device pointers: dispatch, module loading, workspace layout and
// the launch sequence. Shared by the XLA FFI handler (handler.cc) and the benchmark-only library
// (ffi/cuda/bench/dsa_bwd_bench.cc); no XLA or Python here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/dsa_bwd/variants.h"

namespace jax_dsa {

constexpr int64_t kBwdTileM = 64, kBwdTileN = 64, kBwdHeadDimMultiple = 32, kBwdCarveAlign = 128;

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Scratch of one launch: fp32 dPsum and base-2 LSE [round64(S_q), H], fp32 dKV accumulator
// [round64(S_kv), round32(D)], each chunk 128-byte aligned.
inline int64_t StatsBytes(int64_t s_q, int64_t h) {
  return RoundUp(RoundUp(s_q, kBwdTileM) * h * 4, kBwdCarveAlign);
}
inline int64_t AccumElems(int64_t s_kv, int64_t d) {
  return RoundUp(s_kv, kBwdTileN) * RoundUp(d, kBwdHeadDimMultiple);
}
inline int64_t WorkspaceBytes(int64_t s_q, int64_t s_kv, int64_t h, int64_t d) {
  return 2 * StatsBytes(s_q, h) + RoundUp(AccumElems(s_kv, d) * 4, kBwdCarveAlign);
}

// The first entry of `table` matching h, d, k (a negative key matches any), or nullptr.
const DsaBwdKernel* FindBwd(const DsaBwdKernel* table, int n, int h, int d, int k);

// The main kernel for K slots: the slot bucket of exactly K, else the wide variant (any K).
const DsaBwdKernel* FindMainBwd(int h, int d, int k);

// Loads every kernel module on every visible device, once per process (later calls return the
// first call's result). The handler calls it from the INITIALIZE stage, outside graph capture.
cudaError_t LoadBwdKernels();

// Zeroes the atomically-accumulated outputs, then runs preprocess, main, postprocess on a.stream.
// Returns cudaSuccess, or the error with the failed step in *what.
cudaError_t LaunchBwd(const DsaBwdLaunch& a, int h, const DsaBwdKernel* pre,
                      const DsaBwdKernel* main, const DsaBwdKernel* post, std::string* what);

}  // namespace jax_dsa
