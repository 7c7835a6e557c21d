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


def test_xla_refuses_deterministic_on_a_gpu_without_the_flag(monkeypatch):
    """On a GPU, "xla"'s scatter-adds are deterministic only under XLA's flag: without it the
    pure-JAX implementations refuse deterministic=True (the registry then tries the next)."""
    from jax_dsa.ops.sparse_mla.config import Call

    call = Call(np.dtype(np.float32), 4, 576, 512, 8, deterministic=True)
    monkeypatch.setattr(determinism.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert "--xla_gpu_deterministic_ops=true" in determinism.xla_supported(call)
    assert determinism.xla_supported(Call(np.dtype(np.float32), 4, 576, 512, 8)) is None
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert determinism.xla_supported(call) is None
    monkeypatch.setattr(determinism.jax, "default_backend", lambda: "cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert determinism.xla_supported(call) is None


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_host_gradients_do_not_depend_on_the_switch(impl):
    """On the host both implementations already sum in a fixed order: deterministic=True gives
    the default's gradients bit for bit, and the same twice."""
    import jax
    import jax.numpy as jnp

    from jax_dsa import _native, sparse_mla
    if impl not in ("xla",) + _native.available():
        pytest.skip(f"{impl} not built")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 12, 4, 64)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 30, 64)), jnp.float32)
    idx = jnp.asarray(rng.integers(-2, 32, (2, 12, 9)), jnp.int32)

    def grads(det):
        def loss(q, kv):
            out, _ = sparse_mla(q, kv, idx, sm_scale=0.1, d_v=32, implementation=impl,
                                deterministic=det)
            return jnp.sum(out ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)

    a, b, c = grads(True), grads(True), grads(False)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z))
