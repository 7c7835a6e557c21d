"""Tests for jax_dsa.models.glm.indexer: projections, partial RoPE (interleaved for GLM, half-split
for DeepSeek V3.2, on the first qk_rope_head_dim dims), head-weight scale and the top-k selection,
against NumPy float64 (helpers in tests/test_models_glm_attention.py and tests/test_nn_rope.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.models.glm.indexer import Indexer
from jax_dsa.nn.rope import rope_cos_sin
from test_models_glm_attention import FAMILIES, make_layer, np_index_scores, run, small_config


@pytest.mark.parametrize("family", FAMILIES)
def test_projections_match_numpy(family):
    c = small_config(family)
    layer = make_layer(c, seed=4)
    rng = np.random.default_rng(4)
    b, s = 2, 9
    x = rng.standard_normal((b, s, c.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32) + 140, (b, s))
    cos, sin = rope_cos_sin(jnp.asarray(pos), c.rope_parameters, c.qk_rope_head_dim)
    _, _, _, c_q = layer.absorbed_qkv(jnp.asarray(x), cos, sin)
    q, k, w = layer.indexer(jnp.asarray(x), c_q, cos, sin)
    _, (nq, nk, nw) = np_index_scores(layer, c, x, pos)
    assert q.shape == (b, s, c.index_n_heads, c.index_head_dim)
    assert k.shape == (b, s, c.index_head_dim)
    assert w.dtype == jnp.float32
    for got, want in ((q, nq), (k, nk), (w, nw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_flag_matters(family):
    """Flipping indexer_rope_interleave changes the keys: the flag is wired through."""
    c = small_config(family)
    flipped = small_config(family, indexer_rope_interleave=not c.indexer_rope_interleave)
    a, b_ = Indexer(c, rngs=nnx.Rngs(0)), Indexer(flipped, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 6, c.hidden_size))
    c_q = jax.random.normal(jax.random.key(2), (1, 6, c.q_lora_rank))
    pos = jnp.arange(6)[None] + 3
    cos, sin = rope_cos_sin(pos, c.rope_parameters, c.qk_rope_head_dim)
    ka, kb = a(x, c_q, cos, sin)[1], b_(x, c_q, cos, sin)[1]
    r = c.qk_rope_head_dim
    np.testing.assert_array_equal(np.asarray(ka[..., r:]), np.asarray(kb[..., r:]))  # pass dims
    assert float(jnp.max(jnp.abs(ka[..., :r] - kb[..., :r]))) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_topk_against_numpy(family):
    """Sparse-mode slots: distinct visible keys, min(topk, #visible) of them, and their NumPy
    scores are the NumPy top-k scores (robust to ReLU ties), in descending order."""
    c = small_config(family)
    layer = make_layer(c, seed=5)
    rng = np.random.default_rng(5)
    b, s = 2, 11
    x = rng.standard_normal((b, s, c.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    _, aux = run(layer, jnp.asarray(x), compute_indexer_loss=False)
    idx = np.asarray(aux["indices"])
    assert idx.shape == (b, s, c.index_topk) and idx.dtype == np.int32
    scores, _ = np_index_scores(layer, c, x, pos)
    tol = 1e-5 * np.abs(scores).max()
    for bi in range(b):
        for t in range(s):
            n = min(c.index_topk, t + 1)
            row = idx[bi, t]
            assert np.all(row[n:] == -1) and np.all((row[:n] >= 0) & (row[:n] <= t))
            assert len(set(row[:n].tolist())) == n
            want = np.sort(scores[bi, t, : t + 1])[::-1][:n]
            got = scores[bi, t, row[:n]]
            np.testing.assert_allclose(got, want, atol=tol)
            assert np.all(np.diff(got) <= tol)
    # The indexer really selects: some rows pick a set other than the most recent keys.
    recent = [set(range(t - c.index_topk + 1, t + 1)) for t in range(c.index_topk, s)]
    assert any(set(idx[0, t].tolist()) != r for t, r in zip(range(c.index_topk, s), recent))


def test_packed_segments_topk_stays_in_document():
    c = small_config("glm5")
    layer = make_layer(c, seed=6)
    s = 12
    seg = jnp.array([[0] * 5 + [1] * 7])
    pos = jnp.array([list(range(5)) + list(range(7))])
    x = jax.random.normal(jax.random.key(3), (1, s, c.hidden_size))
    _, aux = run(layer, x, pos, seg, compute_indexer_loss=False)
    idx = np.asarray(aux["indices"][0])
    for t in range(s):
        valid = idx[t][idx[t] >= 0]
        lo, hi = (0, t) if t < 5 else (5, t)
        assert np.all((valid >= lo) & (valid <= hi))
        assert len(valid) == min(c.index_topk, hi - lo + 1)


def test_qk_dtype_reaches_the_top_k():
    """Indexer.qk_dtype="float8_e4m3fn" selects by the fp8 scores: the layer's slots equal
    indexer_topk's with that option on the layer's own q, k and weights."""
    from jax_dsa.ops.indexer import indexer_topk

    c = small_config("glm5")
    layer = make_layer(c, seed=7)
    x = jax.random.normal(jax.random.key(4), (2, 11, c.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    cos, sin = rope_cos_sin(pos, c.rope_parameters, c.qk_rope_head_dim)
    q, k, w = layer.indexer(x, layer.absorbed_qkv(x, cos, sin)[3], cos, sin)
    layer.indexer.qk_dtype = "float8_e4m3fn"
    _, aux = run(layer, x, compute_indexer_loss=False)
    want = indexer_topk(q, k, w, topk=c.index_topk, q_positions=pos, kv_positions=pos,
                        qk_dtype="float8_e4m3fn")
    np.testing.assert_array_equal(np.asarray(aux["indices"]), np.asarray(want))
    assert "f8_e4m3fn" in str(jax.make_jaxpr(layer.indexer.topk)(q, k, w, pos))
    with pytest.raises(ValueError, match="qk_dtype must be None or 'float8_e4m3fn'"):
        Indexer(c, rngs=nnx.Rngs(0), qk_dtype="int8")
