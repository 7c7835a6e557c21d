// Shape checks shared by the XLA FFI handlers: a buffer's dims as text for error messages, and
// whether a buffer has exactly the given dims.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_dsa {

inline std::string Dims(xla::ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

template <typename B>
bool Shaped(const B& b, std::initializer_list<int64_t> want) {
  auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

}  // namespace jax_dsa
