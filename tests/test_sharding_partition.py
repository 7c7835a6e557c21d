"""The DSA ops split over 8 CPU devices (tests/conftest.py) equal their unsharded runs.

For each layout (dp, tp, cp, dp+cp+tp) and both mesh axis types (Auto: custom_partitioning with
a Shardy rule; Explicit: shard_map), forward values (out, lse, max_logits) and gradients of
``sparse_mla``,
``indexer_topk`` and ``indexer_kl_loss`` are compared with the same jitted computation on one
device (itself checked against float64 oracles in tests/test_ops_*.py). The
compiled HLO is checked for the collectives each layout needs, and for no others on q / out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_dsa import indexer_kl_loss, indexer_topk, sparse_mla
from jax_dsa.ops import sparse_mla as sparse_mla_module
from jax_dsa.sharding import Layout, derive_layout, partition
from meshes import LAYOUTS, assert_close, collectives, make_mesh, spec

B, S, H, D_QK, D_V, K = 2, 16, 4, 24, 8, 6  # sparse_mla
H_I, D_I, TOPK = 2, 8, 5  # indexer
SM_SCALE = 0.3

IMPLS = [i for i in ("xla", "cpu") if i in sparse_mla_module.AVAILABLE]


def trimmed(p):
    """A PartitionSpec's entries without trailing Nones (the same sharding either way)."""
    entries = list(p)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


# ---------------------------------------------------------------------------------------------
# Inputs


def mla_inputs(rng):
    q = rng.standard_normal((B, S, H, D_QK)).astype(np.float32)
    kv = rng.standard_normal((B, S, D_QK)).astype(np.float32)
    idx = rng.integers(-2, S + 2, (B, S, K)).astype(np.int32)  # some invalid slots
    idx[0, 3] = idx[1, 12] = -1  # rows without a valid slot: lse +inf, max_logits -inf
    sink = rng.standard_normal(H).astype(np.float32)
    w = rng.standard_normal((B, S, H, D_V)).astype(np.float32)
    return q, kv, idx, sink, w


def indexer_inputs(rng):
    iq = rng.standard_normal((B, S, H_I, D_I)).astype(np.float32)
    ik = rng.standard_normal((B, S, D_I)).astype(np.float32)
    iw = rng.standard_normal((B, S, H_I)).astype(np.float32)
    pos = np.tile(np.arange(S, dtype=np.int32), (B, 1))
    seg = np.ones((B, S), np.int32)
    seg[0, 9:] = 2  # two documents in row 0 (per-document positions)
    pos[0, 9:] -= 9
    q = rng.standard_normal((B, S, H, D_QK)).astype(np.float32)
    kv = rng.standard_normal((B, S, D_QK)).astype(np.float32)
    return iq, ik, iw, pos, seg, q, kv


def mla_loss(impl):
    def loss(q, kv, sink, idx, w):
        out, lse, max_logits = sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=D_V, attn_sink=sink,
                                          implementation=impl, return_max_logits=True)
        return jnp.sum(out * w), (out, lse, max_logits)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@functools.cache
def indexer_fn():
    """Jitted: top-k, and the dense and sparse KL losses with their gradients."""

    def topk(iq, ik, iw, pos, seg):
        return indexer_topk(iq, ik, iw, topk=TOPK, q_positions=pos, kv_positions=pos,
                            q_segment_ids=seg, kv_segment_ids=seg)

    def kl(iq, ik, iw, pos, seg, q, kv, idx):
        return indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=SM_SCALE, q_positions=pos,
                               kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                               indices=idx)

    def f(iq, ik, iw, pos, seg, q, kv):
        idx = topk(iq, ik, iw, pos, seg)
        grad = jax.value_and_grad(kl, argnums=(0, 1, 2))
        return idx, grad(iq, ik, iw, pos, seg, q, kv, None), grad(iq, ik, iw, pos, seg, q, kv, idx)

    return jax.jit(f)


@functools.cache
def indexer_reference():
    return indexer_fn()(*indexer_inputs(np.random.default_rng(4)))


@functools.cache
def mla_fn(impl):
    return mla_loss(impl)


@functools.cache
def mla_reference(impl):
    q, kv, idx, sink, w = mla_inputs(np.random.default_rng(0))
    return mla_fn(impl)(q, kv, sink, idx, w)


def check_indexer(got, want):
    got_idx, got_dense, got_sparse = got
    want_idx, want_dense, want_sparse = want
    np.testing.assert_array_equal(got_idx, want_idx)  # global key rows, same selection
    for form, g, w in (("dense", got_dense, want_dense), ("sparse", got_sparse, want_sparse)):
        assert_close(g[0], w[0], what=f"{form} kl")
        for name, a, b in zip(("d_index_q", "d_index_k", "d_index_weights"), g[1], w[1]):
            assert_close(a, b, what=f"{form} {name}")


def put_mla(mesh, q, kv, idx, sink, w):
    return (jax.device_put(q, spec(mesh, "dp", "cp", "tp", None)),
            jax.device_put(kv, spec(mesh, "dp", "cp", None)),
            jax.device_put(sink, spec(mesh, "tp")),
            jax.device_put(idx, spec(mesh, "dp", "cp", None)),
            jax.device_put(w, spec(mesh, "dp", "cp", "tp", None)))


def put_indexer(mesh, iq, ik, iw, pos, seg, q, kv):
    return (jax.device_put(iq, spec(mesh, "dp", "cp", None, None)),
            jax.device_put(ik, spec(mesh, "dp", "cp", None)),
            jax.device_put(iw, spec(mesh, "dp", "cp", None)),
            jax.device_put(pos, spec(mesh, "dp", "cp")),
            jax.device_put(seg, spec(mesh, "dp", "cp")),
            jax.device_put(q, spec(mesh, "dp", "cp", "tp", None)),
            jax.device_put(kv, spec(mesh, "dp", "cp", None)))


# ---------------------------------------------------------------------------------------------
# sparse_mla


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sparse_mla_layouts_equal_unsharded(layout, impl):
    q, kv, idx, sink, w = mla_inputs(np.random.default_rng(0))
    f = mla_fn(impl)
    (_, (want_o, want_lse, want_mx)), want_g = mla_reference(impl)
    assert np.isneginf(want_mx).any() and np.isfinite(want_mx).any()  # empty rows and full ones
    mesh = make_mesh(LAYOUTS[layout])
    with jax.set_mesh(mesh):
        args = put_mla(mesh, q, kv, idx, sink, w)
        compiled = f.lower(*args).compile()
        (_, (got_o, got_lse, got_mx)), got_g = compiled(*args)
        hlo = compiled.as_text()
    assert_close(got_o, want_o, what="out")
    assert_close(got_lse, want_lse, what="lse")
    assert_close(got_mx, want_mx, what="max_logits")
    for name, a, b in zip(("dq", "dkv", "d_attn_sink"), got_g, want_g):
        assert_close(a, b, what=name)
    # Each result stays split like its inputs (no gathered outputs); max_logits like lse.
    assert got_o.sharding.spec == spec(mesh, "dp", "cp", "tp", None)
    assert trimmed(got_lse.sharding.spec) == trimmed(spec(mesh, "dp", "cp", "tp"))
    assert trimmed(got_mx.sharding.spec) == trimmed(spec(mesh, "dp", "cp", "tp"))
    assert got_g[0].sharding.spec == spec(mesh, "dp", "cp", "tp", None)

    sizes = LAYOUTS[layout]
    b, cp, tp = B // sizes.get("dp", 1), sizes.get("cp", 1), sizes.get("tp", 1)
    ops = collectives(hlo)
    gathers = [s for op, shapes in ops if op == "all-gather" for s in shapes]
    scatters = [s for op, shapes in ops if op == "reduce-scatter" for s in shapes]
    if cp > 1:
        # kv gathered along the sequence (forward and backward share it); dkv reduce-scattered
        # back; nothing of q's, out's or lse's shape is gathered.
        assert gathers == [(b, S, D_QK)], ops
        assert scatters == [(b, S // cp, D_QK)], ops
    else:
        assert gathers == [] and scatters == [], ops
    # q, dq, out and dout are the only 4-d arrays: no collective touches them.
    assert not [s for _, shapes in ops for s in shapes if len(s) == 4], ops
    if tp > 1:
        # dkv is summed over the head shards (an all-reduce of kv's local shape).
        reduced = [s for op, shapes in ops if op == "all-reduce" for s in shapes]
        assert (b, S // cp, D_QK) in reduced, ops


def test_sparse_mla_explicit_mesh_equals_unsharded():
    """Explicit axes take the shard_map form: no silent all-gather to the global batch
    (jax-ml/jax#38551), results typed with the layout's shardings."""
    q, kv, idx, sink, w = mla_inputs(np.random.default_rng(0))
    f = mla_fn("xla")
    (_, (want_o, want_lse, want_mx)), want_g = mla_reference("xla")
    mesh = make_mesh(LAYOUTS["dp+cp+tp"], AxisType.Explicit)
    with jax.set_mesh(mesh):
        args = put_mla(mesh, q, kv, idx, sink, w)
        compiled = f.lower(*args).compile()
        (_, (got_o, got_lse, got_mx)), got_g = compiled(*args)
        hlo = compiled.as_text()
        assert jax.typeof(got_o).sharding.spec == P("dp", "cp", "tp", None)
        assert jax.typeof(got_lse).sharding.spec == P("dp", "cp", "tp")
        assert jax.typeof(got_mx).sharding.spec == P("dp", "cp", "tp")
    assert_close(got_o, want_o, what="out")
    assert_close(got_lse, want_lse, what="lse")
    assert_close(got_mx, want_mx, what="max_logits")
    for name, a, b in zip(("dq", "dkv", "d_attn_sink"), got_g, want_g):
        assert_close(a, b, what=name)
    ops = collectives(hlo)
    assert [s for op, shapes in ops if op == "all-gather" for s in shapes] == [(1, S, D_QK)], ops
    assert [s for op, shapes in ops if op == "reduce-scatter" for s in shapes] == [
        (1, S // 2, D_QK)], ops
    assert not [s for _, shapes in ops for s in shapes if len(s) == 4], ops


@pytest.mark.parametrize("check_vma", [False, True])
def test_sparse_mla_inside_user_shard_map(check_vma):
    """Inside shard_map (Manual axes) the op runs on the local shards: context parallelism by
    hand, gathering kv with jax.lax.all_gather, whose transpose reduce-scatters dkv. With
    check_vma the op's results vary over the axes its operands vary over (an FFI result typed
    invariant would have its cotangent summed over them) and its gradients come typed like
    their primals (d_attn_sink of a replicated sink summed over the shards)."""
    q, kv, idx, sink, w = mla_inputs(np.random.default_rng(0))
    (_, (want_o, _, want_mx)), want_g = mla_reference("xla")
    mesh = make_mesh({"cp": 4})

    def local_loss(q, kv, sink, idx, w):
        kv_all = jax.lax.all_gather(kv, "cp", axis=1, tiled=True)
        out, _, max_logits = sparse_mla(q, kv_all, idx, sm_scale=SM_SCALE, d_v=D_V,
                                        attn_sink=sink, return_max_logits=True)
        return jax.lax.psum(jnp.sum(out * w), "cp"), (out, max_logits)

    sharded = jax.shard_map(
        local_loss, mesh=mesh,
        in_specs=(P(None, "cp"), P(None, "cp"), P(), P(None, "cp"), P(None, "cp")),
        out_specs=(P(), (P(None, "cp"), P(None, "cp"))), check_vma=check_vma)
    g = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2), has_aux=True))
    (_, (got_o, got_mx)), got_g = g(q, kv, sink, idx, w)
    assert_close(got_o, want_o, what="out")
    assert_close(got_mx, want_mx, what="max_logits")
    for name, a, b in zip(("dq", "dkv", "d_attn_sink"), got_g, want_g):
        assert_close(a, b, what=name)


def test_vmap_under_a_mesh_falls_back_to_the_plain_kernel():
    q, kv, idx, sink, w = mla_inputs(np.random.default_rng(3))
    one = jax.jit(jax.vmap(lambda q, kv, i: sparse_mla(q, kv, i, sm_scale=SM_SCALE, d_v=D_V,
                                                       return_max_logits=True)))
    want = one(q, kv, idx)
    mesh = make_mesh({"dp": 2})
    with jax.set_mesh(mesh):
        got = one(*(jax.device_put(x, P("dp")) for x in (q, kv, idx)))
    for name, a, b in zip(("out", "lse", "max_logits"), got, want):
        assert_close(a, b, what=f"vmapped {name}")


# ---------------------------------------------------------------------------------------------
# indexer_topk and indexer_kl_loss


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_indexer_layouts_equal_unsharded(layout):
    want = indexer_reference()
    assert (np.asarray(want[0]) >= 0).sum() > B * S * 2  # really selects
    mesh = make_mesh(LAYOUTS[layout])
    f = indexer_fn()
    with jax.set_mesh(mesh):
        args = put_indexer(mesh, *indexer_inputs(np.random.default_rng(4)))
        compiled = f.lower(*args).compile()
        got = compiled(*args)
        hlo = compiled.as_text()
    check_indexer(got, want)
    # The top-k is computed on every head shard and identical on all of them.
    copies = {}
    for shard in got[0].addressable_shards:
        copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
    sizes = LAYOUTS[layout]
    assert len(copies) == sizes.get("dp", 1) * sizes.get("cp", 1)  # split only by dp and cp
    for same in copies.values():
        for c in same[1:]:
            np.testing.assert_array_equal(c, same[0])
    # Queries (index_q, q, [b, s, heads, d]) are never gathered, nor the weights [b, s, heads].
    ops = collectives(hlo)
    gathered = [s for op, shapes in ops if op == "all-gather" for s in shapes]
    assert not [s for s in gathered if len(s) == 4], ops
    assert not [s for s in gathered if len(s) == 3 and s[-1] == H_I], ops


@functools.cache
def topk_scores_fn():
    """Jitted: the fp8 top-k with its scores, and the sparse KL given those scores (and the
    lse of the slots' softmax, so that the index_scores operand is split like the slots)."""

    def f(iq, ik, iw, pos, seg, q, kv):
        idx, scores = indexer_topk(iq, ik, iw, topk=TOPK, q_positions=pos, kv_positions=pos,
                                   q_segment_ids=seg, kv_segment_ids=seg,
                                   qk_dtype="float8_e4m3fn", return_scores=True)
        lse = sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=D_V, implementation="xla")[1]
        kl = jax.value_and_grad(lambda iq, ik, iw: indexer_kl_loss(
            iq, ik, iw, q, kv, sm_scale=SM_SCALE, q_positions=pos, kv_positions=pos,
            q_segment_ids=seg, kv_segment_ids=seg, indices=idx, attention_lse=lse,
            index_scores=scores), argnums=(0, 1, 2))
        return idx, scores, kl(iq, ik, iw)

    return jax.jit(f)


def test_topk_scores_fp8_and_given_scores_equal_unsharded():
    inputs = indexer_inputs(np.random.default_rng(5))
    want = topk_scores_fn()(*inputs)
    mesh = make_mesh(LAYOUTS["dp+cp+tp"])
    with jax.set_mesh(mesh):
        got = topk_scores_fn()(*put_indexer(mesh, *inputs))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert_close(got[2][0], want[2][0], what="kl")
    for name, a, b in zip(("d_index_q", "d_index_k", "d_index_weights"), got[2][1], want[2][1]):
        assert_close(a, b, what=name)


def test_indexer_explicit_mesh_equals_unsharded():
    mesh = make_mesh(LAYOUTS["dp+cp+tp"], AxisType.Explicit)
    with jax.set_mesh(mesh):
        got = indexer_fn()(*put_indexer(mesh, *indexer_inputs(np.random.default_rng(4))))
    check_indexer(got, indexer_reference())


# ---------------------------------------------------------------------------------------------
# Layout derivation


def test_derive_layout_reads_the_query_and_drops_what_does_not_divide():
    sizes = {"dp": 2, "cp": 4, "tp": 2}
    roles = ("bsh.", "bt.")
    lay = derive_layout(sizes, roles, [(4, 16, 4, 8), (4, 16, 8)],
                        [P("dp", "cp", "tp", None), P("dp", None, None)])
    assert lay == Layout(("dp",), ("cp",), ("tp",), True)
    assert lay.spec("bt.") == P("dp", None, None)
    assert lay.spec("bt.", t_split=True) == P("dp", "cp", None)
    # 6 heads do not split 4 ways; keys of length 10 do not scatter over cp=4 -> psum instead.
    lay = derive_layout({"cp": 4, "tp": 4}, roles, [(1, 16, 6, 8), (1, 10, 8)],
                        [P(None, "cp", "tp", None), None])
    assert lay == Layout((), ("cp",), (), False)
    # An axis claimed twice is used once.
    lay = derive_layout({"x": 2}, ("bs",), [(4, 4)], [P("x", "x")])
    assert lay == Layout(("x",), (), (), False)


def test_role_strings_are_checked():
    with pytest.raises(ValueError, match="role string"):
        partition.partitioned_call("op", lambda layout, x: (x,), (jnp.zeros((2, 3)),), ("b",),
                                   (partition.Result("b."),))
