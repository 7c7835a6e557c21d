#!/usr/bin/env bash
# Creates .venv with Python 3.12+ and installs jax_dsa (editable, with its compiled FFI modules)
# with the extras `test` and `examples` (the tests run examples/train.py), pinned by
# constraints.txt. Idempotent: re-running re-installs only when the build inputs (pyproject.toml,
# constraints.txt, CMakeLists.txt, ffi/, jax_dsa/kernel_spec.py) changed.
# JAX_DSA_CUDA=OFF skips the CUDA module; ON makes a missing toolchain an error.
# JAX_DSA_CUDA_SM100=OFF skips the compile-only SM100/SM103 kernel export (default ON).
# JAX_DSA_CUDA_BENCH=OFF skips the benchmark library jax_dsa/libjax_dsa_cuda_bench.so (default ON).
# JAX_DSA_CUDA_SELFTEST=ON also builds the development self-tests (ffi/cuda/selftest) in
# build/*/ffi/cuda (default OFF).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv keeps versions that its shims may not expose while another version is global.
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in $(ls -d "$root"/versions/3.13* "$root"/versions/3.12* 2>/dev/null | sort -rV); do
    if [ -x "$cand/bin/python3" ]; then echo "$cand/bin/python3"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  if ! py=$(find_python); then
    echo "setup: jax_dsa needs Python >= 3.12; none found on PATH (python3.13, python3.12," >&2
    echo "setup: python3) or under pyenv. Install one, or set PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "setup: creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi

stamp=.venv/.jax_dsa-installed
# The build switches and the module list are part of the install: a change of either rebuilds.
settings="JAX_DSA_CUDA=${JAX_DSA_CUDA:-AUTO} JAX_DSA_CUDA_SM100=${JAX_DSA_CUDA_SM100:-ON}"
settings+=" JAX_DSA_CUDA_BENCH=${JAX_DSA_CUDA_BENCH:-ON}"
settings+=" JAX_DSA_CUDA_SELFTEST=${JAX_DSA_CUDA_SELFTEST:-OFF}"
install_state() { echo "$settings"; find jax_dsa -name '*.py' | sort; }
changed() {  # anything the install depends on newer than the stamp, or other switches/modules?
  [ ! -f "$stamp" ] && return 0
  # The editable install (scikit-build-core "redirect" mode) maps the modules it saw when built.
  [ "$(cat "$stamp")" != "$(install_state)" ] && return 0
  # kernel_spec.py: the build's export step reads the kernel variants from it. (Bytecode that the
  # export scripts leave in ffi/ is no input.)
  [ -n "$(find pyproject.toml constraints.txt CMakeLists.txt ffi jax_dsa/kernel_spec.py \
            scripts/setup.sh -name __pycache__ -prune -o -newer "$stamp" -print -quit)" ]
}
if changed; then
  pip_q() { .venv/bin/python -m pip install -q -c constraints.txt "$@"; }
  .venv/bin/python -m pip install -q --upgrade pip
  # The native layer is built with the venv's own build tools (no build isolation), so the FFI
  # headers are those of the pinned jaxlib 0.11.2 and rebuilds need no downloads.
  pip_q scikit-build-core nanobind jaxlib
  if ! cmake_ok=$(cmake --version 2>/dev/null | head -1) ||
     ! printf '3.25\n%s\n' "${cmake_ok##* }" | sort -CV; then
    pip_q cmake  # no CMake >= 3.25 on PATH: use PyPI's
  fi
  # CUDA module (JAX_DSA_CUDA=AUTO|ON|OFF, default AUTO): its build step needs the cuDNN frontend
  # and the CuTe DSL compiler from PyPI, installed only when nvcc is there to use them.
  if [ "${JAX_DSA_CUDA:-AUTO}" != OFF ] && command -v nvcc >/dev/null 2>&1; then
    pip_q -r scripts/cuda-build-requirements.txt
  fi
  pip_q --no-build-isolation -e ".[test,examples]"
  install_state >"$stamp"
fi

# Reference interpreter for tests/test_interop_hf.py: transformers' own GLM-5 / DeepSeek V3.2
# models with torch on the CPU, in .venv-hf (Python 3.10+, it never imports jax_dsa). Optional:
# when it cannot be made, setup goes on and those tests skip with a message. Pins live in
# tests/hf_reference/requirements.txt. The torch CPU wheel is preferred: a local find-links wheel
# (torch-2.13.0+cpu for Python 3.11 on the development machines) or the PyTorch CPU index when it
# answers; otherwise pip falls back to PyPI's (CUDA) build.
find_hf_python() {
  local cand
  for cand in "${HF_PYTHON:-}" python3.11 python3.12 python3.13 python3.10 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' \
         >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  local root
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in $(ls -d "$root"/versions/3.11* "$root"/versions/3.12* "$root"/versions/3.13* \
                  2>/dev/null | sort -rV); do
    if [ -x "$cand/bin/python3" ]; then echo "$cand/bin/python3"; return 0; fi
  done
  return 1
}

hf_req=tests/hf_reference/requirements.txt
hf_stamp=.venv-hf/.hf-reference-installed
if [ "${JAX_DSA_HF_REFERENCE:-ON}" != OFF ] &&
   { [ ! -f "$hf_stamp" ] || [ "$hf_req" -nt "$hf_stamp" ]; }; then
  if ! hf_py=$(find_hf_python); then
    echo "setup: no Python 3.10-3.13 for .venv-hf; the transformers parity tests will skip" >&2
  elif { [ -x .venv-hf/bin/python ] || "$hf_py" -m venv .venv-hf; } &&
       hf_index=() &&
       { ! .venv-hf/bin/python -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=5)' https://download.pytorch.org/whl/cpu/torch/ \
           >/dev/null 2>&1 ||
         hf_index=(--extra-index-url https://download.pytorch.org/whl/cpu); } &&
       .venv-hf/bin/python -m pip install -q "${hf_index[@]}" -r "$hf_req"; then
    touch "$hf_stamp"
  else
    echo "setup: could not install $hf_req into .venv-hf; the transformers parity tests" \
         "will skip" >&2
  fi
fi
