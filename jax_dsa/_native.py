"""Loads the compiled XLA FFI handler modules and registers their targets with JAX.

Modules (built by CMake, see ``CMakeLists.txt``; sources and files per op:
``docs/native_kernels.md``):

* ``jax_dsa._cpu`` (``ffi/cpu/module_cpu.cc``): host sparse MLA forward and backward (always
  built).
* ``jax_dsa._cuda`` (``ffi/cuda/module_cuda.cc``): jax_dsa's SM90 sparse MLA forward and the
  cuDNN frontend's SM90 DSA backward, compiled ahead of time with CuTe DSL (built when
  ``JAX_DSA_CUDA`` is ``AUTO`` and the toolchain is found, or ``ON``).
* ``jax_dsa._cuda_indexer`` (``ffi/cuda/module_cuda_indexer.cc``): the lightning indexer's SM90
  kernels (CUDA C++, built with ``_cuda``).

Each module's ``registrations()`` maps FFI target names to handler capsules (or to
``{"initialize": ..., "execute": ...}``); they are registered as they are, and no environment
variable changes which handler a target gets.

Beside ``_cuda``, and never loaded here, the build installs ``libjax_dsa_cuda_bench.so``: the same
kernels' raw-pointer entries for ``benchmarks/`` (:func:`bench_library`).

Importing this module never fails: a module that cannot be loaded is recorded in
:data:`LOAD_ERRORS` with the reason, and the implementations that need it are left out of
:func:`available`.
"""

from __future__ import annotations

import importlib
import os

import jax

# Module name -> the reason it could not be loaded.
LOAD_ERRORS: dict[str, str] = {}
_MODULES: dict[str, object] = {}


def _load(name: str, platform: str):
    try:
        mod = importlib.import_module(f"jax_dsa.{name}")
    except ImportError as e:  # not built, or built for another Python/ABI
        LOAD_ERRORS[name] = f"{type(e).__name__}: {e}"
        return None
    try:
        for target, capsule in mod.registrations().items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform, api_version=1)
    except Exception as e:  # noqa: BLE001 - recorded and reported by `available`/`require`
        LOAD_ERRORS[name] = f"registering its FFI targets failed: {type(e).__name__}: {e}"
        return None
    _MODULES[name] = mod
    return mod


cpu = _load("_cpu", "cpu")
# CUDA targets may be registered without a GPU: jaxlib queues them until a CUDA plugin loads.
cuda = _load("_cuda", "CUDA")
cuda_indexer = _load("_cuda_indexer", "CUDA")
if cpu is not None:
    # implementation="cuda" placed on the host: a clear error at run time, not "no handler".
    for _mod in (cuda, cuda_indexer):
        for _target in (() if _mod is None else _mod.registrations()):
            jax.ffi.register_ffi_target(_target, cpu.cuda_on_host(), platform="cpu",
                                        api_version=1)


def loaded(name: str) -> bool:
    """Whether the native module ``name`` (``"_cpu"``, ``"_cuda"``, ``"_cuda_indexer"``) loaded."""
    return name in _MODULES


def available() -> tuple[str, ...]:
    """The native implementations whose modules loaded: a subset of ("cpu", "cuda")."""
    return tuple(impl for impl, mod in (("cpu", "_cpu"), ("cuda", "_cuda")) if mod in _MODULES)


def require(name: str):
    """Returns the loaded module (``_cpu``, ``_cuda``, ``_cuda_indexer``); raises
    NotImplementedError with the reason it did not load."""
    if name in _MODULES:
        return _MODULES[name]
    raise NotImplementedError(
        f"jax_dsa: the native module {name} is not available: "
        f"{LOAD_ERRORS.get(name, 'not loaded')}"
    )


BENCH_LIBRARY = "libjax_dsa_cuda_bench.so"


def bench_library() -> str:
    """Path of the benchmark-only library (``ctypes.CDLL`` it): installed next to ``_cuda``, so
    found wherever the module is (the editable install keeps both in site-packages).

    Raises:
      NotImplementedError: ``_cuda`` is not available (the reason from :func:`require`).
      FileNotFoundError: ``_cuda`` was built without it (``JAX_DSA_CUDA_BENCH=OFF``).
    """
    path = os.path.join(os.path.dirname(require("_cuda").__file__), BENCH_LIBRARY)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"jax_dsa: the benchmark library {path} is missing: the CUDA module was built without "
            f"it (JAX_DSA_CUDA_BENCH=OFF); rebuild with JAX_DSA_CUDA_BENCH=ON ./scripts/setup.sh")
    return path
