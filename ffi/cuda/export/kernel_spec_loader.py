"""The build steps' view of ``jax_dsa/kernel_spec.py`` (what the CUDA kernels are compiled for).

The file is loaded by path, not imported as ``jax_dsa.kernel_spec``: the build environment need
not be able to import jax_dsa (nor jax). Its place is fixed relative to this file
(``ffi/cuda/export/`` -> ``jax_dsa/kernel_spec.py``), so a copy of the export scripts
(``benchmarks/tools/build_fwd_variant.sh``) keeps the repository's layout.
"""

from __future__ import annotations

import importlib.util
import json
import os

PATH = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                     "jax_dsa", "kernel_spec.py"))


def load(names) -> dict:
    """``{name: value}`` of the constants ``names`` of kernel_spec.py."""
    if not os.path.isfile(PATH):
        raise SystemExit(f"kernel_spec_loader: {PATH} is missing")
    spec = importlib.util.spec_from_file_location("_jax_dsa_kernel_spec", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {n: getattr(mod, n) for n in names}


def write_stamp(path: str, values: dict) -> None:
    """Writes ``values`` as JSON to ``path`` unless it holds them already. An export step depends
    on its stamp, not on kernel_spec.py itself (Ninja skips the dependants of an output a command
    left untouched), so an edit that changes none of the values it reads re-runs nothing."""
    text = json.dumps(values, indent=1, sort_keys=True) + "\n"
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
