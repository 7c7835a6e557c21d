"""sparse_dense_mla (jax_dsa/ops/sparse_dense_mla/): a slot list into kv plus every visible row
of kv_dense in one softmax, against sparse_mla over the concatenated keys with the whole list
(values and gradients), on "xla" in float64 and float32 and with the host's "cpu" sparse part."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from meshes import LAYOUTS, assert_close, make_mesh, spec

from jax_dsa import _native, sparse_mla
from jax_dsa.ops.indexer import visible_mask
from jax_dsa.ops.sparse_dense_mla import sparse_dense_mla


def _inputs(rng, b, s, s_d, h, d, k, dtype):
    """Packed documents (segment ids, per-document positions); dense rows with positions of
    their own, a few never visible; some queries with no slot, some that see no dense row."""
    q = rng.standard_normal((b, s, h, d))
    kv = rng.standard_normal((b, s, d))
    kvd = rng.standard_normal((b, s_d, d))
    seg = (np.arange(s) >= s // 2).astype(np.int32)[None].repeat(b, 0)
    pos = (np.arange(s) - (s // 2) * seg[0]).astype(np.int32)[None].repeat(b, 0)
    d_seg = (np.arange(s_d) >= s_d // 2).astype(np.int32)[None].repeat(b, 0)
    d_pos = rng.integers(0, s // 2 + 3, (b, s_d)).astype(np.int32)  # some past every query
    idx = rng.integers(-2, s + 2, (b, s, k)).astype(np.int32)
    idx[:, :3] = -1  # rows with no slot (they still see dense rows)
    sink = rng.standard_normal(h)
    cast = lambda x: jnp.asarray(x, dtype)
    return dict(q=cast(q), kv=cast(kv), kvd=cast(kvd), idx=jnp.asarray(idx),
                pos=jnp.asarray(pos), seg=jnp.asarray(seg), d_pos=jnp.asarray(d_pos),
                d_seg=jnp.asarray(d_seg), sink=cast(sink), dout=cast(rng.standard_normal(
                    (b, s, h, d // 2))))


def _reference(x, scale, d_v, impl):
    """sparse_mla over [kv ; kv_dense] with each row's slots then all its visible dense rows."""
    s, s_d = x["kv"].shape[1], x["kvd"].shape[1]
    vis = visible_mask(x["pos"], x["d_pos"], x["seg"], x["d_seg"])  # [b, s, s_d]
    dense_idx = jnp.where(vis, jnp.arange(s_d) + s, -1)
    own = jnp.where((x["idx"] >= 0) & (x["idx"] < s), x["idx"], -1)  # out of range stays invalid
    idx = jnp.concatenate([own, dense_idx], axis=-1)

    def f(q, kv, kvd, sink):
        return sparse_mla(q, jnp.concatenate([kv, kvd], axis=1), idx, sm_scale=scale, d_v=d_v,
                          attn_sink=sink, implementation=impl)
    return f


def _ours(x, scale, d_v, impl):
    def f(q, kv, kvd, sink):
        return sparse_dense_mla(q, kv, x["idx"], kvd, sm_scale=scale, d_v=d_v,
                                q_positions=x["pos"], kv_dense_positions=x["d_pos"],
                                q_segment_ids=x["seg"], kv_dense_segment_ids=x["d_seg"],
                                attn_sink=sink, implementation=impl)
    return f


def _value_and_grads(f, x):
    out, lse = f(x["q"], x["kv"], x["kvd"], x["sink"])
    loss = lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * x["dout"].astype(jnp.float32))
    grads = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(x["q"], x["kv"], x["kvd"], x["sink"])
    return out, lse, grads


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("dtype,impl,tol", [
    (jnp.float64, "xla", 1e-6),  # the ops' lse is float32, and so the merge weights
    (jnp.float32, "xla", 2e-5),
    pytest.param(jnp.float32, "cpu", 2e-5, marks=pytest.mark.skipif(
        "cpu" not in _native.available(), reason="host module not built")),
])
def test_equals_sparse_mla_over_the_whole_list(dtype, impl, tol):
    with jax.enable_x64(dtype == jnp.float64):
        x = _inputs(np.random.default_rng(0), 2, 24, 10, 3, 16, 5, dtype)
        scale, d_v = 16 ** -0.5, 8
        out, lse, grads = _value_and_grads(_ours(x, scale, d_v, impl), x)
        ref_out, ref_lse, ref_grads = _value_and_grads(_reference(x, scale, d_v, "xla"), x)
        assert out.dtype == dtype and out.shape == ref_out.shape
        assert _rel(out, ref_out) < tol
        fin = np.isfinite(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
        got_l, want_l = (np.where(fin, np.asarray(v), 0) for v in (lse, ref_lse))
        assert np.max(np.abs(got_l - want_l)) < tol * 10
        for name, a, b in zip(("dq", "dkv", "dkv_dense", "d_sink"), grads, ref_grads):
            assert _rel(a, b) < tol, name


def test_rows_without_any_key():
    """No slot and no visible dense row: out 0, lse +inf, no gradient from the row."""
    x = _inputs(np.random.default_rng(1), 1, 8, 4, 2, 16, 3, jnp.float32)
    x["idx"] = jnp.full_like(x["idx"], -1)
    x["d_pos"] = jnp.full_like(x["d_pos"], 100)
    out, lse, (dq, dkv, dkvd, dsink) = _value_and_grads(_ours(x, 0.25, 8, "xla"), x)
    assert not np.any(np.asarray(out)) and np.all(np.isinf(np.asarray(lse)))
    for g in (dq, dkv, dkvd, dsink):
        assert np.all(np.asarray(g) == 0)


def test_bad_arguments_are_named():
    x = _inputs(np.random.default_rng(2), 1, 8, 4, 2, 16, 3, jnp.float32)
    with pytest.raises(ValueError, match="sparse_dense_mla: the slot part: sparse_mla: indices"):
        sparse_dense_mla(x["q"], x["kv"], x["idx"][:, :5], x["kvd"], sm_scale=0.25, d_v=8,
                         q_positions=x["pos"], kv_dense_positions=x["d_pos"])
    with pytest.raises(ValueError, match="the dense part .* kv_positions"):
        sparse_dense_mla(x["q"], x["kv"], x["idx"], x["kvd"], sm_scale=0.25, d_v=8,
                         q_positions=x["pos"], kv_dense_positions=x["d_pos"][:, :2])
    with pytest.raises(TypeError, match="the dense part"):
        sparse_dense_mla(x["q"], x["kv"], x["idx"], x["kvd"].astype(jnp.bfloat16),
                         sm_scale=0.25, d_v=8, q_positions=x["pos"],
                         kv_dense_positions=x["d_pos"])


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_dp_cp_tp_mesh_equals_unsharded(axis_type):
    """dp=2, cp=2, tp=2: each part split by its op's rules (batch and heads split, keys gathered
    along the sequence); the merge and the sink's gradient across head shards as unsharded."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    x = _inputs(np.random.default_rng(3), 2, 16, 8, 4, 16, 5, jnp.float32)
    specs = dict(q=("dp", "cp", "tp", None), kv=("dp", "cp", None), kvd=("dp", "cp", None),
                 sink=("tp",), idx=("dp", "cp", None), pos=("dp", "cp"), seg=("dp", "cp"),
                 d_pos=("dp", "cp"), d_seg=("dp", "cp"), dout=("dp", "cp", "tp", None))

    @jax.jit
    def f(y):
        out, _, grads = _value_and_grads(_ours(y, 0.25, 8, "xla"), y)
        return out, grads

    want_out, want_g = f(x)
    mesh = make_mesh(LAYOUTS["dp+cp+tp"], axis_type)
    with jax.set_mesh(mesh):
        got_out, got_g = f({n: jax.device_put(a, spec(mesh, *specs[n])) for n, a in x.items()})
    assert_close(got_out, want_out, what="out")
    for name, a, b in zip(("dq", "dkv", "dkv_dense", "d_sink"), got_g, want_g):
        assert_close(a, b, rel=1e-4, what=name)


@pytest.mark.gpu
def test_gpu_cuda_parts_match_float64():
    """On an SM90 GPU: both parts on "cuda" (bf16, V4 widths: H 64, D_qk = d_v = 512, a
    128-slot window and 1500 dense rows, a sink, packed documents) against float64 "xla"."""
    rng = np.random.default_rng(5)
    b, s, s_d, h, d = 1, 1024, 1500, 64, 512
    x = _inputs(rng, b, s, s_d, h, d, 128, jnp.float32)
    window = np.arange(s)[:, None] - np.arange(128)[None, :]
    x["idx"] = jnp.asarray(np.where(window >= 0, window, -1)[None].astype(np.int32))
    x["d_pos"] = jnp.asarray(rng.integers(0, s // 2, (b, s_d)).astype(np.int32))
    x["dout"] = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)  # d_v = D_qk here
    bf = {k: (x[k].astype(jnp.bfloat16) if k in ("q", "kv", "kvd", "dout") else x[k]) for k in x}
    bf["q"] = (bf["q"].astype(jnp.float32) * 0.3).astype(jnp.bfloat16)
    out, lse, grads = _value_and_grads(_ours(bf, d ** -0.5, d, "cuda"), bf)
    with jax.enable_x64(True):
        f64 = {k: (v.astype(jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v)
               for k, v in bf.items()}
        ref_out, ref_lse, ref_grads = _value_and_grads(_ours(f64, d ** -0.5, d, "xla"), f64)
    assert _rel(out, ref_out) < 1e-2
    fin = np.isfinite(np.asarray(ref_lse))
    got_l, want_l = (np.where(fin, np.asarray(v), 0) for v in (lse, ref_lse))
    assert np.max(np.abs(got_l - want_l)) < 1e-2
    for name, a, r in zip(("dq", "dkv", "dkv_dense", "d_sink"), grads, ref_grads):
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        assert _rel(a, r) < 1e-2, name
