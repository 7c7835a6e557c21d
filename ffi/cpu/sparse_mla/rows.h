// Per-query row kernels of the host sparse MLA, compiled once per instruction set
// (rows_isa.cc: baseline x86-64 and AVX2+FMA); the handler picks one (handler.cc: by CPUID).
#pragma once

#include <cstdint>

namespace jax_dsa {

enum class Dtype : int { kF32, kF64, kBF16, kF16 };

struct RowsShape {
  int64_t s_q, h, d, s_kv, k, d_v;
  double sm_scale;
};

// Query rows [begin, end) of one batch element. Pointers are the batch element's bases.
struct FwdRows {
  const void* q;          // [S_q, H, D]
  const void* kv;         // [S_kv, D]
  const int32_t* idx;     // [S_q, K]
  const int32_t* len;     // [S_q]
  const void* sink;       // [H], accumulation type
  void* out;              // [S_q, H, d_v]
  float* lse;             // [S_q, H]
  float* max_logits;      // [S_q, H]
  int64_t begin, end;
};

struct BwdRows {
  const void* q;
  const void* kv;
  const int32_t* idx;
  const int32_t* len;
  const void* sink;
  const void* out;        // [S_q, H, d_v]
  const float* lse;       // [S_q, H]
  const void* dout;       // [S_q, H, d_v]
  void* dq;               // [S_q, H, D]
  void* dkv_acc;          // [S_kv, D] accumulation type, this worker's
  void* dsink_acc;        // [H] accumulation type, this worker's
  int64_t begin, end;
};

struct RowKernels {
  void (*forward)(Dtype, const RowsShape&, const FwdRows&);
  void (*backward)(Dtype, const RowsShape&, const BwdRows&);
  const char* isa;
};

RowKernels RowKernelsBaseline();
RowKernels RowKernelsAvx2();

}  // namespace jax_dsa
