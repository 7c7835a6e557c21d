"""Test-wide setup.

* 8 host (CPU) devices, so that the sharding tests can build meshes. XLA reads the device count
  when JAX starts its backends, so the flag goes into ``XLA_FLAGS`` at import time, before any
  test module imports jax. A count already given by the caller wins. Outside ``-m gpu``, XLA's
  backend compiles without LLVM optimisations (the tests' programs are small and run once).
* The ``gpu`` marker: tests that run jax_dsa's CUDA kernels on an SM90 GPU (``make test-gpu``
  runs exactly these, ``pytest -m gpu``). Where :func:`requires_sm90` gives a reason they skip
  with it; under ``-m gpu`` that reason is an error instead (a GPU run that ran nothing must not
  pass), except with ``--collect-only``. Lowering checks that only need the CUDA module built are not ``gpu`` tests.
* This folder is on ``sys.path`` (pytest's default import mode puts a rootless conftest's
  folder there), so test modules in the sub-folders import the shared helpers ``oracle``
  (float64 references), ``cuda_doubles`` (the kernels' pure-JAX contracts) and ``meshes``. With
  no ``__init__.py`` anywhere under tests/, every test file's name must be unique.
"""

import functools
import os

import pytest

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_OPT_LEVEL_FLAG = "--xla_backend_optimization_level"

_flags = os.environ.get("XLA_FLAGS", "")
if _DEVICE_COUNT_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_DEVICE_COUNT_FLAG}=8".strip()

GPU_MODULES = ("_cuda", "_cuda_indexer")


def pytest_configure(config):
    # The suite compiles thousands of small programs and runs each once: unoptimised, they
    # compile sooner (`make test` a third faster). Not for `-m gpu`: XLA's GPU kernels run at
    # real sizes there.
    flags = os.environ.get("XLA_FLAGS", "")
    if _OPT_LEVEL_FLAG not in flags and (config.getoption("markexpr", "") or "").strip() != "gpu":
        os.environ["XLA_FLAGS"] = f"{flags} {_OPT_LEVEL_FLAG}=0".strip()


@functools.cache
def requires_sm90() -> str | None:
    """Why this process cannot run the ``gpu`` tests, or None: they need an SM90 GPU as JAX's
    default backend and jax_dsa's CUDA modules loaded."""
    import jax

    from jax_dsa import _native
    from jax_dsa.ops.registry import sm90_device_error

    backend = jax.default_backend()
    if backend != "gpu":
        return f"needs an SM90 GPU (JAX's default backend is {backend!r})"
    why = sm90_device_error()
    if why:
        return why
    for module in GPU_MODULES:
        if not _native.loaded(module):
            return (f"needs jax_dsa.{module}, which did not load: "
                    f"{_native.LOAD_ERRORS.get(module, 'not built')}")
    return None


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected
def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    why = requires_sm90()
    if why is None:
        return
    if ((config.getoption("markexpr", "") or "").strip() == "gpu"
            and not config.getoption("collectonly")):
        raise pytest.UsageError(f"-m gpu selects {len(gpu)} GPU tests, but this machine cannot "
                                f"run them: {why}")
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in gpu:
        item.add_marker(skip)
