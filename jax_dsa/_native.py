"""Loads the compiled XLA FFI handler modules and registers their targets with JAX.

Modules (built by CMake, see ``CMakeLists.txt``):

* ``jax_dsa._cpu``: host sparse MLA forward and backward (always built).
* ``jax_dsa._cuda``: the cuDNN frontend's SM90 DSA backward, compiled ahead of time with CuTe DSL
  (built when ``JAX_DSA_CUDA`` is ``AUTO`` and the toolchain is found, or ``ON``).

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


def _load(name: str, platform: str, **registration_options):
    try:
        mod = importlib.import_module(f"jax_dsa.{name}")
    except ImportError as e:  # not built, or built for another Python/ABI
        LOAD_ERRORS[name] = f"{type(e).__name__}: {e}"
        return None
    try:
        for target, capsule in mod.registrations(**registration_options).items():
            jax.ffi.register_ffi_target(target, capsule, platform=platform, api_version=1)
    except Exception as e:  # noqa: BLE001 - recorded and reported by `available`/`require`
        LOAD_ERRORS[name] = f"registering its FFI targets failed: {type(e).__name__}: {e}"
        return None
    _MODULES[name] = mod
    return mod


cpu = _load("_cpu", "cpu")
# CUDA targets may be registered without a GPU: jaxlib queues them until a CUDA plugin loads.
# JAX_DSA_CUDA_GRAPHS=0 registers the backward without the command-buffer trait (A/B checks).
cuda = _load("_cuda", "CUDA", graphs=os.environ.get("JAX_DSA_CUDA_GRAPHS", "1") != "0")
if cpu is not None and cuda is not None:
    # implementation="cuda" placed on the host: a clear error at run time, not "no handler".
    for _target in ("jax_dsa_sparse_mla_fwd_cuda", "jax_dsa_dsa_bwd_cuda"):
        jax.ffi.register_ffi_target(_target, cpu.cuda_on_host(), platform="cpu", api_version=1)


def available() -> tuple[str, ...]:
    """The native implementations whose modules loaded: a subset of ("cpu", "cuda")."""
    return tuple(impl for impl, mod in (("cpu", "_cpu"), ("cuda", "_cuda")) if mod in _MODULES)


def require(name: str):
    """Returns the loaded module ``_cpu`` or ``_cuda``; raises NotImplementedError with the reason."""
    if name in _MODULES:
        return _MODULES[name]
    raise NotImplementedError(
        f"jax_dsa: the native module {name} is not available: "
        f"{LOAD_ERRORS.get(name, 'not loaded')}"
    )
