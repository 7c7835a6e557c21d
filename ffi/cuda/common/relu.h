// relu as jax.nn.relu computes it: a NaN stays NaN. fmaxf(NaN, 0) is 0, which would turn a
// poisoned index_q into finite index scores (a NaN that is read must propagate).
#pragma once

namespace jax_dsa {

__device__ __forceinline__ float Relu(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace jax_dsa
