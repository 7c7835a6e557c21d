"""Tests for jax_dsa.models.deepseek_v4.moe (DeepSeek V4's MoE block) against a float64 NumPy
oracle, one token at a time, written from transformers 5.24's ``DeepseekV4TopKRouter`` /
``DeepseekV4HashRouter`` / ``DeepseekV4Experts`` / ``DeepseekV4MLP`` math (whole-model parity with
transformers is in tests/test_models_deepseek_v4_checkpoint.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.moe import DeepseekV4MoE, default_tid2eid


def _silu(x):
    return x / (1 + np.exp(-x))


def _swiglu(x, gate, up, down, limit):
    g = np.minimum(x @ gate.T, limit)
    u = np.clip(x @ up.T, -limit, limit)
    return (_silu(g) * u) @ down.T


def _oracle(block, x, ids, c):
    p = {"/".join(map(str, k)): np.asarray(v.get_value(), np.float64)
         for k, v in nnx.to_flat_state(nnx.state(block))}
    logits = x @ p["gate/weight"].T
    s = np.sqrt(np.log1p(np.exp(logits))) if c.scoring_func == "sqrtsoftplus" else (
        1 / (1 + np.exp(-logits)))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if block.is_hash:
            idx = p["gate/tid2eid"][ids[t]].astype(int)
        else:
            idx = np.argsort(-(s[t] + p["gate/e_score_correction_bias"]))[:c.num_experts_per_tok]
        w = s[t, idx] / s[t, idx].sum() * c.routed_scaling_factor
        for j, e in enumerate(idx):
            out[t] += w[j] * _swiglu(x[t], p["experts/gate_proj"][e], p["experts/up_proj"][e],
                                     p["experts/down_proj"][e], c.swiglu_limit)
        out[t] += _swiglu(x[t], p["shared_experts/gate_proj/weight"],
                          p["shared_experts/up_proj/weight"],
                          p["shared_experts/down_proj/weight"], c.swiglu_limit)
    return out


@pytest.mark.parametrize("layer, scoring", [(0, "sqrtsoftplus"), (1, "sigmoid")])
def test_moe_matches_oracle(layer, scoring):
    """Layer 0 of the tiny preset is hash-routed, layer 1 top-k; the clip at 0.5 is active."""
    c = get_config("deepseek-v4-tiny", hidden_size=16, moe_intermediate_size=8, vocab_size=32,
                   n_routed_experts=5, num_experts_per_tok=2, swiglu_limit=0.5,
                   scoring_func=scoring, routed_scaling_factor=1.7)
    block = DeepseekV4MoE(c, layer, rngs=nnx.Rngs(0))
    assert block.is_hash == (layer == 0)
    rng = np.random.default_rng(layer)
    for _, var in nnx.to_flat_state(nnx.state(block)):
        v = var.get_value()
        if jnp.issubdtype(v.dtype, jnp.floating):
            var.set_value(jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[-1]),
                                      v.dtype))
    if block.is_hash:  # a random table with distinct experts per token
        table = np.stack([rng.permutation(5)[:2] for _ in range(32)]).astype(np.int32)
        block.gate.tid2eid.set_value(jnp.asarray(table))
    x = rng.standard_normal((3, 7, 16)) * 2
    ids = rng.integers(0, 32, (3, 7))
    got = nnx.jit(lambda b, x, i: b(x, i))(block, jnp.asarray(x, jnp.float32),
                                           jnp.asarray(ids, jnp.int32))
    want = _oracle(block, x.reshape(-1, 16), ids.reshape(-1), c).reshape(3, 7, 16)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # the gradient reaches the router weight through the gate values, not the choice
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)
    xs, idj = jnp.asarray(x, jnp.float32), jnp.asarray(ids, jnp.int32)
    g = jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p, rest)(xs, idj).sum()))(params)
    assert np.abs(np.asarray(g["gate"]["weight"][...])).max() > 0


def test_hash_layer_needs_ids_and_default_table_is_balanced():
    c = get_config("deepseek-v4-tiny", hidden_size=16, moe_intermediate_size=8)
    block = DeepseekV4MoE(c, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_ids"):
        block(jnp.zeros((1, 4, c.hidden_size)))
    table = np.asarray(default_tid2eid(256, 4, 2))
    assert all(len(set(row)) == 2 for row in table)
    assert np.bincount(table.ravel(), minlength=4).tolist() == [128] * 4
    with pytest.raises(ValueError, match="layer_idx"):
        DeepseekV4MoE(c, c.num_hidden_layers, rngs=nnx.Rngs(0))
