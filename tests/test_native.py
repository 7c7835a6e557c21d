"""The compiled FFI modules: loading, registration, the host handlers' batching and errors.

The numerics of implementation="cpu" against the float64 oracle are in tests/test_ops_sparse_mla.py
(every oracle test there runs once per host implementation).
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa import _native, dense_mla, sparse_mla
from jax_dsa.ops import sparse_mla as sparse_mla_module
from jax_dsa.ops.sparse_mla import cpu as sparse_mla_cpu


def test_cpu_module_is_built_and_registered():
    assert "cpu" in sparse_mla_module.AVAILABLE, _native.LOAD_ERRORS.get("_cpu")
    mod = _native.require("_cpu")
    # Built against jaxlib 0.11.2's headers, so it loads on jax 0.11.2 and every newer jax.
    assert tuple(mod.FFI_API_VERSION) == (0, 4)
    assert mod.kernel_isa() in ("avx2+fma", "baseline")
    assert set(mod.registrations()) == {sparse_mla_cpu.CPU_FWD_TARGET, sparse_mla_cpu.CPU_BWD_TARGET}


def test_require_names_the_reason():
    with pytest.raises(NotImplementedError, match="_nonexistent"):
        _native.require("_nonexistent")


def _inputs(rng, batch, s_q=12, s_kv=10, h=2, d=8, k=5):
    q = rng.standard_normal(batch + (s_q, h, d)).astype(np.float32)
    kv = rng.standard_normal(batch + (s_kv, d)).astype(np.float32)
    idx = rng.integers(-2, s_kv + 2, batch + (s_q, k)).astype(np.int32)
    return q, kv, idx


def _loss(impl, sm_scale=0.4, d_v=6):
    def f(q, kv, idx, sink):
        out, _ = sparse_mla(q, kv, idx, sm_scale=sm_scale, d_v=d_v, attn_sink=sink,
                            implementation=impl)
        return jnp.sum(jnp.sin(out))
    return f


@pytest.mark.parametrize("in_axes", [(0, None, 0, None), (0, 0, None, 0), (None, 0, 0, None)])
def test_vmap_with_unbatched_operands_matches_xla(in_axes):
    """vmap_method="expand_dims": unbatched operands arrive with a size-1 dim and broadcast."""
    rng = np.random.default_rng(0)
    q, kv, idx = _inputs(rng, (3,))
    sink = rng.standard_normal((3, 2)).astype(np.float32)
    args = [q, kv, idx, sink]
    args = [a if ax is not None else a[0] for a, ax in zip(args, in_axes)]
    results = {}
    for impl in ("xla", "cpu"):
        fwd = jax.vmap(lambda q, kv, i, s, impl=impl: sparse_mla(
            q, kv, i, sm_scale=0.4, d_v=6, attn_sink=s, implementation=impl,
            return_max_logits=True), in_axes)
        grad = jax.vmap(jax.grad(_loss(impl), (0, 1, 3)), in_axes)
        results[impl] = jax.jit(fwd)(*args) + tuple(jax.jit(grad)(*args))
    for a, b in zip(results["cpu"], results["xla"]):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_nested_vmap_and_batch_dims_match_xla():
    rng = np.random.default_rng(1)
    q, kv, idx = _inputs(rng, (2, 3, 2))
    sink = rng.standard_normal(2).astype(np.float32)
    results = {}
    for impl in ("xla", "cpu"):
        g = jax.grad(_loss(impl), (0, 1, 3))
        g = jax.vmap(jax.vmap(g, (0, 0, 0, None)), (0, None, 0, None))
        results[impl] = g(q, kv[0], idx, sink)
    for a, b in zip(results["cpu"], results["xla"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def _raw_forward(q, kv, idx, sink, length, d_v=4, sm_scale=0.5, max_logits_shape=None):
    lead = q.shape[:-1]
    call = jax.ffi.ffi_call(
        sparse_mla_cpu.CPU_FWD_TARGET,
        (jax.ShapeDtypeStruct(lead + (d_v,), q.dtype), jax.ShapeDtypeStruct(lead, jnp.float32),
         jax.ShapeDtypeStruct(max_logits_shape or lead, jnp.float32)))
    return call(q, kv, idx, sink, length, sm_scale=np.float64(sm_scale), d_v=np.int64(d_v))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(length=np.zeros((1, 5), np.int32)), "topk_length"),
        (dict(sink=np.zeros(3, np.float32)), "attn_sink"),
        (dict(sink=np.zeros(2, np.float16)), "attn_sink"),
        (dict(kv=np.zeros((1, 6, 7), np.float32)), "kv"),
        (dict(kv=np.zeros((1, 6, 8), np.float16)), "kv"),
        (dict(idx=np.zeros((1, 4, 3), np.int32)), "indices"),
        (dict(d_v=9), "d_v"),
        (dict(max_logits_shape=(1, 4, 3)), "max_logits"),
    ],
)
def test_handler_errors_name_the_argument(change, match):
    """Inputs that bypass the public op's checks are refused by the handler with a named error."""
    args = dict(q=np.zeros((1, 4, 2, 8), np.float32), kv=np.zeros((1, 6, 8), np.float32),
                idx=np.zeros((1, 4, 3), np.int32), sink=np.zeros(2, np.float32),
                length=np.full((1, 4), 3, np.int32))
    args.update(change)
    d_v = args.pop("d_v", 4)
    if "idx" in change:
        args["idx"] = np.zeros((1, 5, 3), np.int32)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_raw_forward(**args, d_v=d_v))
    # The unchanged call works.
    ok = dict(q=np.zeros((1, 4, 2, 8), np.float32), kv=np.zeros((1, 6, 8), np.float32),
              idx=np.zeros((1, 4, 3), np.int32), sink=np.zeros(2, np.float32),
              length=np.full((1, 4), 3, np.int32))
    jax.block_until_ready(_raw_forward(**ok))


def test_default_on_the_host_is_the_cpu_handler():
    rng = np.random.default_rng(2)
    q, kv, idx = _inputs(rng, ())
    loss = lambda q, kv: sparse_mla(q, kv, idx, sm_scale=0.3, d_v=8)[0].sum()
    text = jax.jit(jax.grad(loss, (0, 1))).lower(q, kv).as_text()
    assert jax.default_backend() == "cpu"
    assert sparse_mla_cpu.CPU_FWD_TARGET in text and sparse_mla_cpu.CPU_BWD_TARGET in text


def test_baseline_kernels_match_xla():
    """The non-AVX2 row kernels (chosen on older CPUs) give the same results, in a subprocess."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import jax_dsa._cpu as c
        from jax_dsa import sparse_mla
        assert c.use_kernel_isa("baseline") == "baseline" == c.kernel_isa(), c.kernel_isa()
        rng = np.random.default_rng(3)
        q = rng.standard_normal((20, 3, 24)).astype(np.float32)
        kv = rng.standard_normal((15, 24)).astype(np.float32)
        idx = rng.integers(-1, 16, (20, 9)).astype(np.int32)
        sink = jnp.asarray(rng.standard_normal(3), jnp.float32)
        def run(impl):
            f = lambda q, kv, s: jnp.sum(sparse_mla(q, kv, idx, sm_scale=0.3, d_v=16,
                attn_sink=s, implementation=impl)[0] ** 2)
            return jax.value_and_grad(f, (0, 1, 2))(q, kv, sink)
        a, b = run("cpu"), run("xla")
        err = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        print("max_abs_err", err)
        assert err < 1e-4, err
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "max_abs_err" in r.stdout


def test_cpu_backward_is_deterministic():
    """Slots of many queries hit the same kv rows: dkv must not depend on thread scheduling."""
    rng = np.random.default_rng(3)
    s, h, d = 512, 4, 32
    q = jnp.asarray(rng.standard_normal((s, h, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((s, d)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 8, (s, 16)), jnp.int32)  # 8 hot rows
    grad = jax.jit(jax.grad(
        lambda q, kv: sparse_mla(q, kv, idx, sm_scale=0.2, d_v=d, implementation="cpu")[0].sum(),
        argnums=(0, 1)))
    first = grad(q, kv)
    for _ in range(8):
        again = grad(q, kv)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])


@pytest.mark.skipif(not {"cpu", "cuda"} <= set(_native.available()),
                    reason="needs the host and CUDA modules")
def test_cuda_run_on_the_host_says_why():
    """implementation="cuda" lowers on the host (a single name is not checked against the
    backend), and running it there fails with the host's stand-in handler's message."""
    q = jnp.ones((1, 8, 64, 576), jnp.bfloat16)
    kv = jnp.ones((1, 8, 576), jnp.bfloat16)
    pos = jnp.arange(8)[None]
    f = jax.jit(lambda q, kv: dense_mla(q, kv, sm_scale=0.05, q_positions=pos, kv_positions=pos,
                                        implementation="cuda"))
    with pytest.raises(Exception, match="an op called with implementation='cuda' needs an SM90"):
        jax.block_until_ready(f(q, kv))
