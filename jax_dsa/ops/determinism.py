"""The ops' ``deterministic`` switch: gradients bitwise identical from run to run.

``deterministic=None`` (every op's default) follows XLA's own switch, the flag
``--xla_gpu_deterministic_ops=true`` in ``XLA_FLAGS``, read when the op is traced; ``True`` or
``False`` overrides it for that call.
"""

from __future__ import annotations

import os

import jax
import numpy as np

_FLAG = "--xla_gpu_deterministic_ops"


def xla_deterministic_ops() -> bool:
    """Whether ``XLA_FLAGS`` sets ``--xla_gpu_deterministic_ops`` (bare, ``=true`` or ``=1``;
    the last occurrence wins, as in XLA's own parsing)."""
    on = False
    for word in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = word.partition("=")
        if name == _FLAG:
            on = value.lower() in ("", "true", "1")
    return on


def resolve(op: str, deterministic) -> bool:
    """``deterministic`` of a call to ``op``: ``None`` -> :func:`xla_deterministic_ops`.

    Raises:
      TypeError: ``deterministic`` is not ``None`` or a bool.
    """
    if deterministic is None:
        return xla_deterministic_ops()
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"{op}: deterministic must be None or a Python bool, got "
                        f"{deterministic!r}")
    return bool(deterministic)


def xla_supported(call) -> str | None:
    """A ``supported`` check for the pure-JAX implementations: their backward's scatter-adds are
    deterministic on the host, and on a GPU only under XLA's flag (XLA then sorts them)."""
    if (call.deterministic and jax.default_backend() == "gpu"
            and not xla_deterministic_ops()):
        return (f"implementation='xla' is deterministic on a GPU only with XLA_FLAGS="
                f"{_FLAG}=true")
    return None
