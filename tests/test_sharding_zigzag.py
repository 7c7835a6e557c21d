"""Causal load balance: the zigzag layout, the work counts, and the DSA ops on zigzag tokens.

The work counts are checked against brute force over :func:`jax_dsa.visible_mask` and against
the valid slots that ``indexer_topk`` really returns per context-parallel shard; the ops run on
zigzag-ordered tokens over a cp=4 mesh and give the natural-order results back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_dsa import indexer_kl_loss, indexer_topk, sparse_mla, visible_mask
from jax_dsa.sharding import (
    causal_work,
    from_zigzag,
    imbalance,
    to_zigzag,
    work_per_shard,
    zigzag_permutation,
)
from meshes import assert_close, make_mesh


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_shards_hold_chunks_r_and_2cp_minus_1_minus_r(cp):
    s = 8 * cp
    perm = zigzag_permutation(s, cp)
    assert sorted(perm.tolist()) == list(range(s))
    chunk = s // (2 * cp)
    for r, shard in enumerate(perm.reshape(cp, -1)):
        want = list(range(r * chunk, (r + 1) * chunk))
        want += list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
        assert shard.tolist() == want
    x = np.arange(3 * s).reshape(3, s)
    np.testing.assert_array_equal(to_zigzag(x, cp), x[:, perm])
    np.testing.assert_array_equal(from_zigzag(to_zigzag(x, cp), cp), x)
    xj = jnp.asarray(x.T)  # JAX arrays, sequence on axis 0
    np.testing.assert_array_equal(from_zigzag(to_zigzag(xj, cp, axis=0), cp, axis=0), x.T)


def test_zigzag_argument_errors():
    with pytest.raises(ValueError, match="multiple of 2 \\* cp"):
        zigzag_permutation(12, 4)
    with pytest.raises(ValueError, match="cp must be"):
        zigzag_permutation(12, 0)


def test_causal_work_matches_brute_force():
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 4, 40))
    pos = np.concatenate([np.arange(n) for n in np.bincount(seg)])
    perm = rng.permutation(40)  # any token order
    pos, seg = pos[perm], seg[perm]
    vis = np.asarray(visible_mask(pos, pos, seg, seg))
    np.testing.assert_array_equal(causal_work(pos, seg), vis.sum(-1))
    np.testing.assert_array_equal(causal_work(pos, seg, topk=3), np.minimum(vis.sum(-1), 3))


def test_contiguous_is_imbalanced_and_zigzag_is_balanced():
    s, cp = 64, 4
    pos = np.arange(s)
    contiguous = work_per_shard(causal_work(pos), cp)
    # Shard r: sum of (p + 1) over its 16 positions.
    want = [sum(p + 1 for p in range(r * 16, (r + 1) * 16)) for r in range(cp)]
    np.testing.assert_array_equal(contiguous, want)
    assert imbalance(contiguous) == pytest.approx(max(want) / np.mean(want))
    assert imbalance(contiguous) > 1.3
    zigzag = work_per_shard(causal_work(to_zigzag(pos, cp, axis=0)), cp)
    assert zigzag.sum() == contiguous.sum()
    assert imbalance(zigzag) == 1.0


def test_ops_on_zigzag_tokens_give_the_natural_order_back():
    """indexer_topk, the sparse KL and sparse_mla on zigzag tokens split over cp=4: the slots
    (mapped back to natural rows), the outputs (put back in natural order) and the losses and
    gradients equal the natural-order unsharded run; the valid slots per shard are the counts
    of causal_work."""
    rng = np.random.default_rng(1)
    b, s, h_i, d_i, h, d_qk, d_v, topk, cp = 1, 32, 2, 8, 2, 16, 8, 6, 4
    # Positive queries and keys: index scores have no ties, so the selection is unique.
    iq = rng.random((b, s, h_i, d_i)).astype(np.float32)
    ik = rng.random((b, s, d_i)).astype(np.float32)
    iw = rng.random((b, s, h_i)).astype(np.float32)
    q = rng.standard_normal((b, s, h, d_qk)).astype(np.float32)
    kv = rng.standard_normal((b, s, d_qk)).astype(np.float32)
    pos = np.arange(s, dtype=np.int32)[None]

    def run(iq, ik, iw, q, kv, pos):
        idx = indexer_topk(iq, ik, iw, topk=topk, q_positions=pos, kv_positions=pos)

        def losses(iq, ik, iw, q, kv):
            out, _ = sparse_mla(q, kv, idx, sm_scale=0.25, d_v=d_v)
            kl = indexer_kl_loss(iq, ik, iw, q, kv, sm_scale=0.25, q_positions=pos,
                                 kv_positions=pos, indices=idx)
            return jnp.sum(jnp.sin(out)) + kl, (out, kl)

        (_, (out, kl)), grads = jax.value_and_grad(losses, argnums=(0, 1, 2, 3, 4),
                                                   has_aux=True)(iq, ik, iw, q, kv)
        return idx, out, kl, grads

    f = jax.jit(run)
    want_idx, want_out, want_kl, want_g = f(iq, ik, iw, q, kv, pos)
    perm = zigzag_permutation(s, cp)
    mesh = make_mesh({"cp": cp})
    with jax.set_mesh(mesh):
        zz = [jax.device_put(to_zigzag(x, cp), P(None, "cp")) for x in (iq, ik, iw, q, kv, pos)]
        idx, out, kl, grads = f(*zz)
    idx = np.asarray(idx)
    natural_idx = np.where(idx >= 0, perm[np.maximum(idx, 0)], -1)
    np.testing.assert_array_equal(from_zigzag(natural_idx, cp), want_idx)
    assert_close(from_zigzag(np.asarray(out), cp), want_out, what="out")
    assert_close(kl, want_kl, what="kl")
    for name, g, w in zip(("d_index_q", "d_index_k", "d_index_weights", "dq", "dkv"), grads,
                          want_g):
        assert_close(from_zigzag(np.asarray(g), cp), w, what=name)
    # Valid slots per shard, as the op returned them, are the counted work.
    slots = (idx[0] >= 0).sum(-1)
    np.testing.assert_array_equal(work_per_shard(slots, cp),
                                  work_per_shard(causal_work(to_zigzag(pos[0], cp, axis=0),
                                                             topk=topk), cp))
    natural = (np.asarray(want_idx)[0] >= 0).sum(-1)
    np.testing.assert_array_equal(natural, causal_work(pos[0], topk=topk))
