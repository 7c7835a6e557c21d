"""jax_dsa.ops.determinism: the ``deterministic`` switch and XLA's flag."""

import numpy as np
import pytest

from jax_dsa.ops import determinism


@pytest.mark.parametrize("flags,want", [
    ("", False),
    ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops_extra=true", False),
    ("--xla_dump_to=/tmp --xla_gpu_deterministic_ops=TRUE", True),
])
def test_xla_flag(monkeypatch, flags, want):
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert determinism.xla_deterministic_ops() is want
    assert determinism.resolve("op", None) is want
    assert determinism.resolve("op", True) is True
    assert determinism.resolve("op", np.bool_(False)) is False


@pytest.mark.parametrize("value", [1, "true", 0.0])
def test_resolve_rejects_non_bools(value):
    with pytest.raises(TypeError, match="op: deterministic must be None or a Python bool"):
        determinism.resolve("op", value)
