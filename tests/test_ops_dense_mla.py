"""Tests for jax_dsa.dense_mla: dense attention from positions and segment ids.

Forward (out, lse) and gradients (dq, dkv, d_attn_sink) against a float64 NumPy oracle (itself
checked by finite differences) with packed documents, rows that see no key, an attention sink
and S not a multiple of the query block; equality with ``sparse_mla`` over ``dense_indices`` at
GLM-5's and DeepSeek V4's absorbed widths; argument errors; the implementation registry (a
forward without a backward pairs with the "xla" backward); the sharding contract on the 8-device
CPU mesh of tests/conftest.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_dsa import dense_mla, sparse_mla
from jax_dsa.nn.slots import dense_indices
from jax_dsa.ops.dense_mla import REGISTRY, op as dense_op, xla as dense_xla
from jax_dsa.ops.registry import Implementation, Registry, always
import oracle
from meshes import LAYOUTS, assert_close, collectives, make_mesh, spec

SM_SCALE = 0.3


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def packed_inputs(rng, b, s_q, s_kv, h, d_qk, d_v, dtype=np.float32):
    """Random q, kv, sink, cotangent w; row 0 holds three documents (per-document positions),
    row 1 has keys at later positions than its first queries (those see no key)."""
    q = rng.standard_normal((b, s_q, h, d_qk)).astype(dtype)
    kv = rng.standard_normal((b, s_kv, d_qk)).astype(dtype)
    sink = rng.standard_normal(h).astype(np.float32)
    w = rng.standard_normal((b, s_q, h, d_v)).astype(np.float32)
    q_pos = np.tile(np.arange(s_q, dtype=np.int32), (b, 1))
    kv_pos = np.tile(np.arange(s_kv, dtype=np.int32), (b, 1))
    q_seg = np.zeros((b, s_q), np.int32)
    kv_seg = np.zeros((b, s_kv), np.int32)
    # row 0: documents [0, a), [a, c), [c, S) for queries and keys alike
    for lo, hi, doc in ((s_q // 3, 2 * s_q // 3, 1), (2 * s_q // 3, s_q, 2)):
        q_seg[0, lo:hi] = doc
        q_pos[0, lo:hi] -= lo
    for lo, hi, doc in ((s_kv // 3, 2 * s_kv // 3, 1), (2 * s_kv // 3, s_kv, 2)):
        kv_seg[0, lo:hi] = doc
        kv_pos[0, lo:hi] -= lo
    kv_pos[1] += 4  # queries at positions 0..3 of row 1 see no key
    return q, kv, sink, w, (q_pos, kv_pos, q_seg, kv_seg)


def test_oracle_gradients_match_finite_differences():
    """The oracle's analytic gradients against central differences of its own forward."""
    rng = np.random.default_rng(0)
    q, kv, sink, w, vis = packed_inputs(rng, 2, 7, 9, 2, 5, 3, np.float64)
    sink, w = sink.astype(np.float64), w.astype(np.float64)
    kw = dict(scale=SM_SCALE, d_v=3)

    def loss(q, kv, sink):
        return np.sum(oracle.dense_mla(q, kv, *vis, sink, w, **kw)[0] * w)

    _, _, (dq, dkv, d_sink) = oracle.dense_mla(q, kv, *vis, sink, w, **kw)
    eps = 1e-6
    for x, g, idx in ((q, dq, (0, 5, 1, 2)), (kv, dkv, (0, 4, 1)), (kv, dkv, (1, 2, 4)),
                      (sink, d_sink, (1,))):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        args = [q, kv, sink]
        i = next(j for j, a in enumerate(args) if a is x)
        fp = loss(*[xp if j == i else a for j, a in enumerate(args)])
        fm = loss(*[xm if j == i else a for j, a in enumerate(args)])
        assert abs((fp - fm) / (2 * eps) - g[idx]) < 1e-6 * max(1.0, abs(g[idx])), idx
        assert abs(g[idx]) > 1e-4  # a real, non-trivial entry


# ---------------------------------------------------------------------------------------------
# Against the oracle


def value_and_grads(d_v, segmented, with_sink, implementation="xla"):
    def loss(q, kv, sink, w, q_pos, kv_pos, q_seg, kv_seg):
        out, lse = dense_mla(
            q, kv, sm_scale=SM_SCALE, d_v=d_v, q_positions=q_pos, kv_positions=kv_pos,
            q_segment_ids=q_seg if segmented else None,
            kv_segment_ids=kv_seg if segmented else None,
            attn_sink=sink if with_sink else None, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("segmented,with_sink", [(True, True), (False, False)])
def test_forward_and_gradients_match_float64_oracle(monkeypatch, segmented, with_sink):
    """S_q 37 in blocks of 16 (a partial last block), S_kv 29: packed documents, rows without a
    visible key, a sink."""
    monkeypatch.setattr(dense_xla, "_MAX_BLOCK_Q", 16)
    assert dense_xla.default_block_q(37, 3, 29) == 16
    rng = np.random.default_rng(1)
    b, s_q, s_kv, h, d_qk, d_v = 2, 37, 29, 3, 24, 8
    q, kv, sink, w, vis = packed_inputs(rng, b, s_q, s_kv, h, d_qk, d_v)
    if not segmented:
        vis = (vis[0], vis[1], None, None)
    sink_used = sink if with_sink else np.full(h, -np.inf, np.float32)
    want_out, want_lse, want_g = oracle.dense_mla(q, kv, *vis, sink_used, w, scale=SM_SCALE,
                                                  d_v=d_v)
    segs = vis[2:] if segmented else (vis[0], vis[1])  # placeholders, unused
    f = value_and_grads(d_v, segmented, with_sink)
    (_, (out, lse)), grads = f(q, kv, sink, w, vis[0], vis[1], *segs)

    assert out.shape == (b, s_q, h, d_v) and out.dtype == jnp.float32
    assert lse.shape == (b, s_q, h) and lse.dtype == jnp.float32
    empty = np.isinf(want_lse)
    assert empty[1, :4].all() and not empty[0].any()  # rows without a key exist
    np.testing.assert_array_equal(np.asarray(lse)[empty], np.inf)
    np.testing.assert_array_equal(np.asarray(out)[np.broadcast_to(empty[..., None], out.shape)], 0)
    assert rel_l2(out, want_out) < 1e-5
    assert np.max(np.abs(np.asarray(lse)[~empty] - want_lse[~empty])) < 1e-5
    for name, g, gw in zip(("dq", "dkv", "d_attn_sink"), grads, want_g):
        assert np.all(np.isfinite(np.asarray(g))), name
        if name == "d_attn_sink" and not with_sink:
            np.testing.assert_array_equal(np.asarray(g), 0)  # a -inf sink takes no mass
            continue
        assert rel_l2(g, gw) < 1e-5, name
    dq = np.asarray(grads[0])
    np.testing.assert_array_equal(dq[1, :4], 0)  # rows without a key pass no gradient
    # Sensitivity: the segment ids matter (row 0 would leak across documents without them).
    if segmented:
        leak, _, _ = oracle.dense_mla(q, kv, vis[0], vis[1], None, None, sink_used, w,
                                      scale=SM_SCALE, d_v=d_v)
        assert rel_l2(leak, want_out) > 1e-2


@pytest.mark.parametrize("d_qk,d_v,with_sink,dtype", [
    (576, 512, False, jnp.float32),   # GLM-5 / DeepSeek V3.2 absorbed widths
    (512, 512, True, jnp.bfloat16),   # DeepSeek V4 (K = V, sink)
])
def test_equals_sparse_mla_over_dense_indices(d_qk, d_v, with_sink, dtype):
    """The same out, lse and gradients as sparse_mla over every visible key, at the models'
    widths (few heads, short S)."""
    rng = np.random.default_rng(2)
    b, s, h = 2, 19, 2
    q, kv, sink, w, (q_pos, _, q_seg, _) = packed_inputs(rng, b, s, s, h, d_qk, d_v)
    q, kv = jnp.asarray(q, dtype) * 0.2, jnp.asarray(kv, dtype)  # logits of O(1) at D 576
    sink = jnp.asarray(sink) if with_sink else None
    idx = dense_indices(q_pos, q_pos, q_seg, q_seg)

    def dense_loss(q, kv, sink):
        out, lse = dense_mla(q, kv, sm_scale=SM_SCALE, d_v=d_v, q_positions=q_pos,
                             kv_positions=q_pos, q_segment_ids=q_seg, kv_segment_ids=q_seg,
                             attn_sink=sink)
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    def sparse_loss(q, kv, sink):
        out, lse = sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=d_v, attn_sink=sink,
                              implementation="xla")
        return jnp.sum(out.astype(jnp.float32) * w), (out, lse)

    argnums = (0, 1, 2) if with_sink else (0, 1)

    @jax.jit
    def both(q, kv, sink):
        return tuple(jax.value_and_grad(f, argnums=argnums, has_aux=True)(q, kv, sink)
                     for f in (dense_loss, sparse_loss))

    ((_, (out, lse)), g), ((_, (want_out, want_lse)), want_g) = both(q, kv, sink)
    assert out.dtype == want_out.dtype == dtype and lse.dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert rel_l2(out, want_out) < tol
    assert rel_l2(lse, want_lse) < 1e-5
    for name, a, bb in zip(("dq", "dkv", "d_attn_sink"), g, want_g):
        assert a.dtype == bb.dtype, name
        assert rel_l2(a, bb) < tol, name
    # and against the oracle (not two copies of one mistake)
    sink64 = np.asarray(sink) if with_sink else np.full(h, -np.inf)
    ref_out, _, _ = oracle.dense_mla(np.asarray(q, np.float64), np.asarray(kv, np.float64),
                                     q_pos, q_pos, q_seg, q_seg, sink64, w, scale=SM_SCALE,
                                     d_v=d_v)
    assert rel_l2(out, ref_out) < tol


def test_leading_batch_dims_and_vmap():
    """[2, 2, S, ...] inputs equal each batch element alone, and vmap over the op."""
    rng = np.random.default_rng(3)
    s, h, d_qk, d_v = 11, 2, 16, 8
    q = rng.standard_normal((2, 2, s, h, d_qk)).astype(np.float32)
    kv = rng.standard_normal((2, 2, s, d_qk)).astype(np.float32)
    pos = np.broadcast_to(rng.permutation(s).astype(np.int32), (2, 2, s))  # any order works
    kw = dict(sm_scale=SM_SCALE, d_v=d_v)
    out, lse = jax.jit(lambda q, kv, p: dense_mla(q, kv, q_positions=p, kv_positions=p, **kw))(
        q, kv, pos)
    want, want_lse, _ = oracle.dense_mla(q, kv, pos, pos, None, None, np.full(h, -np.inf),
                                         np.zeros((2, 2, s, h, d_v)), scale=SM_SCALE, d_v=d_v)
    assert rel_l2(out, want) < 1e-5 and rel_l2(lse, want_lse) < 1e-5
    vm, _ = jax.jit(jax.vmap(lambda q, kv, p: dense_mla(q, kv, q_positions=p, kv_positions=p,
                                                        **kw)))(
        q.reshape(4, s, h, d_qk), kv.reshape(4, s, d_qk), pos.reshape(4, s))
    assert rel_l2(vm, want.reshape(4, s, h, d_v)) < 1e-5


# ---------------------------------------------------------------------------------------------
# Argument checks and the registry


def _call(**overrides):
    rng = np.random.default_rng(4)
    args = dict(q=jnp.asarray(rng.standard_normal((2, 6, 2, 8)), jnp.float32),
                kv=jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32),
                sm_scale=0.5, d_v=4, q_positions=jnp.zeros((2, 6), jnp.int32),
                kv_positions=jnp.zeros((2, 6), jnp.int32))
    args.update(overrides)
    q, kv = args.pop("q"), args.pop("kv")
    return dense_mla(q, kv, **args)


@pytest.mark.parametrize("overrides,error,match", [
    (dict(sm_scale=None), TypeError, "sm_scale must be a Python number"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale must be finite and > 0"),
    (dict(q=jnp.zeros((6, 8))), ValueError, r"q must be \[..., S_q, H, D_qk\]"),
    (dict(kv=jnp.zeros((2, 6, 7))), ValueError, "kv's last dim 7 must equal q's D_qk 8"),
    (dict(kv=jnp.zeros((3, 6, 8))), ValueError, "kv must be"),
    (dict(kv=jnp.zeros((2, 6, 8), jnp.bfloat16)), TypeError, "share one float dtype"),
    (dict(d_v=9), ValueError, "d_v must be an int with 0 < d_v <= D_qk=8"),
    (dict(attn_sink=jnp.zeros(3)), ValueError, r"attn_sink must be \[H\]"),
    (dict(attn_sink=jnp.zeros(2, jnp.int32)), TypeError, "attn_sink must be a float"),
    (dict(q_positions=None), TypeError, "q_positions and kv_positions are required"),
    (dict(q_positions=jnp.zeros((2, 5), jnp.int32)), ValueError, "q_positions must have shape"),
    (dict(kv_positions=jnp.zeros((2, 6))), TypeError, "kv_positions must be an integer"),
    (dict(q_segment_ids=jnp.zeros((2, 6), jnp.int32)), ValueError, "give both q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 6), jnp.int32), kv_segment_ids=jnp.zeros((2, 5), jnp.int32)),
     ValueError, "kv_segment_ids must have shape"),
    (dict(implementation="nope"), ValueError, "implementation must be one of"),
])
def test_bad_arguments_raise_at_trace_time(overrides, error, match):
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda: _call(**overrides))


def test_registry_and_a_forward_without_backward_pairs_with_the_xla_backward(monkeypatch):
    """A new implementation plugs in as forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink,
    config) -> (out, lse); with backward=None the "xla" backward runs."""
    assert "xla" in REGISTRY.names and REGISTRY.preference("cpu") == ("xla",)
    calls = []

    def kernel_forward(*args):
        calls.append(len(args))
        return dense_xla.IMPLEMENTATION.forward(*args)

    fake = Implementation("kernel", always, kernel_forward, backward=None)
    reg = Registry("dense_mla", (dense_xla.IMPLEMENTATION, fake), preference={"default": ("xla",)})
    monkeypatch.setattr(dense_op, "REGISTRY", reg)
    rng = np.random.default_rng(5)
    q, kv, sink, w, (q_pos, kv_pos, q_seg, kv_seg) = packed_inputs(rng, 2, 9, 9, 2, 8, 4)

    @functools.partial(jax.jit, static_argnums=2)
    def grads(q, kv, impl):
        def loss(q, kv):
            out, _ = dense_mla(q, kv, sm_scale=SM_SCALE, d_v=4, q_positions=q_pos,
                               kv_positions=kv_pos, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                               attn_sink=sink, implementation=impl)
            return jnp.sum(out * w)

        return jax.grad(loss, argnums=(0, 1))(q, kv)

    got = grads(q, kv, "kernel")
    assert calls == [8]  # forward traced once, with the documented operands and config
    want = grads(q, kv, "xla")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_default_block_q_bounds_the_block():
    assert dense_xla.default_block_q(10, 4, 10) == 16  # covers a short sequence
    assert dense_xla.default_block_q(1 << 17, 64, 1 << 17) == 2  # 128K tokens, 64 heads
    b = dense_xla.default_block_q(16384, 64, 16384)
    assert b * 64 * 16384 <= 1 << 24 and b == 16


def test_no_quadratic_buffer_in_the_jaxpr():
    """Neither pass holds an [S_q, S_kv] or [S_q, H, S_kv] array for the whole sequence."""
    s, h = 512, 2
    q = jax.ShapeDtypeStruct((1, s, h, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, s, 16), jnp.float32)
    pos = jnp.arange(s, dtype=jnp.int32)[None]

    def loss(q, kv):
        return jnp.sum(dense_mla(q, kv, sm_scale=0.1, d_v=8, q_positions=pos, kv_positions=pos,
                                 q_segment_ids=pos // 100, kv_segment_ids=pos // 100)[0])

    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, kv))
    assert "128,2,512]" in text  # the blocks' logits are in the printed jaxpr
    assert f"{s},{s}]" not in text and f"{s},{h},{s}]" not in text


# ---------------------------------------------------------------------------------------------
# Sharding


@functools.cache
def _sharded_loss():
    def loss(q, kv, sink, w, pos, seg):
        out, lse = dense_mla(q, kv, sm_scale=SM_SCALE, d_v=8, q_positions=pos, kv_positions=pos,
                             q_segment_ids=seg, kv_segment_ids=seg, attn_sink=sink)
        return jnp.sum(out * w), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _sharding_inputs():
    q, kv, sink, w, (pos, _, seg, _) = packed_inputs(np.random.default_rng(6), 2, 16, 16, 4,
                                                     24, 8)
    return q, kv, sink, w, pos, seg


def _put(mesh, q, kv, sink, w, pos, seg):
    return (jax.device_put(q, spec(mesh, "dp", "cp", "tp", None)),
            jax.device_put(kv, spec(mesh, "dp", "cp", None)),
            jax.device_put(sink, spec(mesh, "tp")),
            jax.device_put(w, spec(mesh, "dp", "cp", "tp", None)),
            jax.device_put(pos, spec(mesh, "dp", "cp")),
            jax.device_put(seg, spec(mesh, "dp", "cp")))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_layout_dp_cp_tp_equals_unsharded(axis_type):
    """dp=2, cp=2, tp=2: batch and heads split, kv and key positions gathered along the
    sequence, dkv reduce-scattered back; results split like the queries."""
    args = _sharding_inputs()
    f = _sharded_loss()
    (_, (want_o, want_lse)), want_g = f(*args)
    mesh = make_mesh(LAYOUTS["dp+cp+tp"], axis_type)
    with jax.set_mesh(mesh):
        placed = _put(mesh, *args)
        compiled = f.lower(*placed).compile()
        (_, (got_o, got_lse)), got_g = compiled(*placed)
        out_spec = jax.typeof(got_o).sharding.spec
    assert_close(got_o, want_o, what="out")
    assert_close(got_lse, want_lse, what="lse")
    for name, a, b in zip(("dq", "dkv", "d_attn_sink"), got_g, want_g):
        assert_close(a, b, what=name)
    if axis_type == AxisType.Explicit:
        assert out_spec == P("dp", "cp", "tp", None)
    else:
        assert got_o.sharding.spec == P("dp", "cp", "tp", None)
    ops = collectives(compiled.as_text())
    gathers = [s for op, shapes in ops if op == "all-gather" for s in shapes]
    scatters = [s for op, shapes in ops if op == "reduce-scatter" for s in shapes]
    assert (1, 16, 24) in gathers, ops  # kv, whole along the sequence
    assert scatters == [(1, 8, 24)], ops  # dkv back to its shard
    assert not [s for _, shapes in ops for s in shapes if len(s) == 4], ops  # q, out untouched
