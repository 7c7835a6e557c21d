"""Tests for jax_dsa.models.deepseek_v4.compression_layout (layout of compressed entries in packed
rows, gated pooling) and jax_dsa.models.deepseek_v4.compressor, against float64 NumPy oracles that
walk each document on its own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.compression_layout import (
    NO_ENTRY_POSITION,
    compression_layout,
    pool,
)
from jax_dsa.models.deepseek_v4.compressor import V4Compressor
from jax_dsa.models.deepseek_v4.config import CSA, HCA


def _packed_positions(lengths, pad=0):
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad, np.int64)])
    seg = np.concatenate([np.full(n, d + 1) for d, n in enumerate(lengths)] + [np.zeros(pad)])
    return pos.astype(np.int32), seg.astype(np.int32)


def _documents(lengths):
    """(start row, length) of each document."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return list(zip(starts.tolist(), lengths))


def _oracle_entries(lengths, m):
    """Per document, its entries in order: (rows of window i, rows of window i-1 or None)."""
    out = []
    for start, n in _documents(lengths):
        for i in range(n // m):
            cur = list(range(start + i * m, start + (i + 1) * m))
            prev = list(range(start + (i - 1) * m, start + i * m)) if i > 0 else None
            out.append((cur, prev, i))
    return out


@pytest.mark.parametrize("m", [4, 16])
def test_layout_matches_per_document_walk(m):
    lengths = [37, 5, 64, 50]  # incomplete windows, a document shorter than m, exact multiples
    pos, seg = _packed_positions(lengths, pad=4)
    s = len(pos)
    layout = compression_layout(jnp.asarray(pos)[None], m, jnp.asarray(seg)[None])
    entries = _oracle_entries(lengths, m)
    c = s // m
    assert layout.end_rows.shape == (1, c) and len(entries) <= c
    end_rows = np.asarray(layout.end_rows[0])
    valid = np.asarray(layout.valid[0])
    np.testing.assert_array_equal(end_rows[: len(entries)], [e[0][-1] for e in entries])
    assert valid[: len(entries)].all() and not valid[len(entries):].any()
    assert (end_rows[len(entries):] == s).all()
    np.testing.assert_array_equal(
        np.asarray(layout.window_start[0])[: len(entries)], [e[2] * m for e in entries]
    )
    assert (np.asarray(layout.positions[0])[len(entries):] == NO_ENTRY_POSITION).all()
    # Visible entries of each query: its own document's entries i with (i + 1) * m - 1 <= p.
    first, count = np.asarray(layout.first[0]), np.asarray(layout.count[0])
    ent_seg = np.asarray(layout.segment_ids[0])
    for t in range(s):
        want = [k for k, e in enumerate(entries) if seg[e[0][0]] == seg[t] and seg[t] != 0
                and e[0][-1] <= t]
        got = list(range(first[t], first[t] + count[t]))
        assert got == want, t
        assert (ent_seg[got] == seg[t]).all()


@pytest.mark.parametrize("overlap", [False, True])
def test_pool_against_numpy(overlap):
    m, d = 4, 6
    lengths = [13, 9, 22]
    pos, seg = _packed_positions(lengths, pad=3)
    s = len(pos)
    rng = np.random.default_rng(0)
    w = 2 * d if overlap else d
    kv = rng.standard_normal((1, s, w))
    gate = rng.standard_normal((1, s, w))
    bias = rng.standard_normal((m, w))
    layout = compression_layout(jnp.asarray(pos)[None], m, jnp.asarray(seg)[None])
    with jax.enable_x64(True):
        got = np.asarray(pool(jnp.asarray(kv), jnp.asarray(gate), jnp.asarray(bias), layout,
                              overlap=overlap))[0]
    entries = _oracle_entries(lengths, m)
    want = np.zeros((s // m, d))
    for k, (cur, prev, _) in enumerate(entries):
        if overlap:
            zs = [gate[0, cur, d:] + bias[:, d:]]
            vs = [kv[0, cur, d:]]
            if prev is not None:
                zs.insert(0, gate[0, prev, :d] + bias[:, :d])
                vs.insert(0, kv[0, prev, :d])
            z, v = np.concatenate(zs), np.concatenate(vs)
        else:
            z, v = gate[0, cur] + bias, kv[0, cur]
        p = np.exp(z - z.max(axis=0))
        want[k] = np.sum(p / p.sum(axis=0) * v, axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_compressor_entries_depend_only_on_their_document():
    """Packing two documents gives each one the entries it has alone (RoPE at document
    positions, overlap never reaching into the previous document)."""
    c = get_config("deepseek-v4-tiny")
    for layer_type in (CSA, HCA):
        comp = V4Compressor(c, layer_type, rngs=nnx.Rngs(1))
        comp.position_bias.set_value(
            jax.random.normal(jax.random.key(2), comp.position_bias.get_value().shape)
        )
        m = comp.ratio
        l1, l2 = 3 * m + 1, 2 * m + 3
        x = jax.random.normal(jax.random.key(3), (1, l1 + l2, c.hidden_size))
        pos, seg = _packed_positions([l1, l2])

        @nnx.jit
        def run(comp, x, pos, seg, m=m, l1=l1, l2=l2):  # one compile for the three calls
            return (comp(x, compression_layout(pos[None], m, seg[None])),
                    comp(x[:, :l1], compression_layout(jnp.arange(l1)[None], m)),
                    comp(x[:, l1:], compression_layout(jnp.arange(l2)[None], m)))

        packed, alone1, alone2 = run(comp, x, jnp.asarray(pos), jnp.asarray(seg))
        np.testing.assert_allclose(np.asarray(packed[0, :3]), np.asarray(alone1[0, :3]),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(packed[0, 3:5]), np.asarray(alone2[0, :2]),
                                   rtol=1e-5, atol=1e-6)
        assert not np.asarray(packed[0, 5:]).any()  # unused rows are zero


def test_layout_errors():
    with pytest.raises(ValueError, match="ratio"):
        compression_layout(jnp.zeros((1, 8), jnp.int32), 1)
    with pytest.raises(ValueError, match="positions"):
        compression_layout(jnp.zeros((8,), jnp.int32), 4)
    with pytest.raises(ValueError, match="layer_type"):
        V4Compressor(get_config("deepseek-v4-tiny"), "sliding_attention", rngs=nnx.Rngs(0))
