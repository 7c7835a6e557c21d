"""jax_dsa.models.glm.moe against a float64 NumPy oracle of transformers' router and experts
(``GlmMoeDsaTopkRouter`` / ``GlmMoeDsaExperts`` / ``GlmMoeDsaMoE``), and its gradients against a
dense all-experts formulation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import DSAConfig
from jax_dsa.models.glm.moe import MoE

BASE = DSAConfig(
    hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    v_head_dim=4, index_topk=4, index_n_heads=2, index_head_dim=4, vocab_size=32,
    mlp_layer_types=("dense", "sparse"), moe_intermediate_size=6, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
)


def _moe(config, seed=0):
    rng = np.random.default_rng(seed)
    moe = MoE(config, rngs=nnx.Rngs(0))
    e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    moe.gate.weight[...] = jnp.asarray(rng.standard_normal((e, h)) / np.sqrt(h), jnp.float32)
    moe.gate.e_score_correction_bias[...] = jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32)
    for name, shape in (("gate_proj", (e, i, h)), ("up_proj", (e, i, h)), ("down_proj", (e, h, i))):
        getattr(moe.experts, name)[...] = jnp.asarray(
            rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32)
    for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj,
                moe.shared_experts.down_proj):
        lin.weight[...] = jnp.asarray(
            rng.standard_normal(lin.weight[...].shape) / np.sqrt(lin.in_features), jnp.float32)
    return moe


def _np(a):
    return np.asarray(a, np.float64)


def _oracle_route(x, moe, c):
    """Per token: {expert: gate value}, in float64."""
    w, bias = _np(moe.gate.weight[...]), _np(moe.gate.e_score_correction_bias[...])
    s = 1.0 / (1.0 + np.exp(-(x @ w.T)))
    out = []
    per = c.n_routed_experts // c.n_group
    for t in range(x.shape[0]):
        choice = s[t] + bias
        groups = choice.reshape(c.n_group, per)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-gscore, kind="stable")[: c.topk_group]
        masked = np.full_like(choice, -np.inf)
        for g in keep:
            masked[g * per:(g + 1) * per] = choice[g * per:(g + 1) * per]
        idx = np.argsort(-masked, kind="stable")[: c.num_experts_per_tok]
        vals = s[t, idx]
        if c.norm_topk_prob:
            vals = vals / (vals.sum() + 1e-20)
        out.append(dict(zip(idx.tolist(), (vals * c.routed_scaling_factor).tolist(), strict=True)))
    return out


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _oracle_moe(x, moe, c):
    gp, up, dp = (_np(getattr(moe.experts, n)[...]) for n in ("gate_proj", "up_proj", "down_proj"))
    sh = moe.shared_experts
    sg, su, sd = (_np(lin.weight[...]) for lin in (sh.gate_proj, sh.up_proj, sh.down_proj))
    out = (_silu(x @ sg.T) * (x @ su.T)) @ sd.T
    for t, route in enumerate(_oracle_route(x, moe, c)):
        for e, g in route.items():
            out[t] += g * ((_silu(gp[e] @ x[t]) * (up[e] @ x[t])) @ dp[e].T)
    return out


@pytest.mark.parametrize("changes", [{}, {"norm_topk_prob": False, "routed_scaling_factor": 1.0},
                                     {"n_group": 1, "topk_group": 1}])
def test_moe_matches_oracle(changes):
    c = dataclasses.replace(BASE, **changes)
    moe = _moe(c)
    x = np.random.default_rng(1).standard_normal((2, 5, c.hidden_size)).astype(np.float32)
    flat = x.reshape(-1, c.hidden_size).astype(np.float64)
    w, idx = moe.gate(jnp.asarray(x.reshape(-1, c.hidden_size)))
    for t, route in enumerate(_oracle_route(flat, moe, c)):
        got = dict(zip(np.asarray(idx[t]).tolist(), np.asarray(w[t]).tolist(), strict=True))
        assert got.keys() == route.keys()
        np.testing.assert_allclose([got[e] for e in route], list(route.values()), rtol=1e-5)
    out = np.asarray(moe(jnp.asarray(x)))
    assert out.shape == x.shape
    ref = _oracle_moe(flat, moe, c).reshape(x.shape)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_correction_bias_steers_choice_only():
    c = BASE
    moe = _moe(c)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((16, c.hidden_size)), jnp.float32)
    w1, i1 = moe.gate(x)
    moe.gate.e_score_correction_bias[...] = jnp.zeros(c.n_routed_experts)
    w0, i0 = moe.gate(x)
    o1, o0 = np.argsort(np.asarray(i1), -1), np.argsort(np.asarray(i0), -1)
    i1, w1 = np.take_along_axis(np.asarray(i1), o1, -1), np.take_along_axis(np.asarray(w1), o1, -1)
    i0, w0 = np.take_along_axis(np.asarray(i0), o0, -1), np.take_along_axis(np.asarray(w0), o0, -1)
    same = np.all(i1 == i0, axis=-1)
    assert not same.all()
    # Where the chosen set is unchanged, so are the gate values (they come from unbiased scores).
    assert same.any()
    np.testing.assert_allclose(w1[same], w0[same], rtol=1e-6)


def test_gradients_match_dense_formulation():
    """Gradients through the dropless ragged_dot path equal those of a dense all-experts sum
    weighted by the same gate values (the choice itself carries no gradient)."""
    c = BASE
    moe = _moe(c)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((6, c.hidden_size)), jnp.float32)
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

    def sparse_loss(params, x):
        m = nnx.merge(graphdef, params, rest)
        return jnp.sum(jnp.sin(m(x)))

    def dense_loss(params, x):
        m = nnx.merge(graphdef, params, rest)
        w, idx = m.gate(x)
        combine = jnp.zeros((x.shape[0], c.n_routed_experts)).at[
            jnp.arange(x.shape[0])[:, None], idx].add(w)
        gp, up, dp = m.experts.gate_proj[...], m.experts.up_proj[...], m.experts.down_proj[...]
        h = jax.nn.silu(jnp.einsum("th,eih->tei", x, gp)) * jnp.einsum("th,eih->tei", x, up)
        y = jnp.einsum("tei,ehi->teh", h, dp)
        return jnp.sum(jnp.sin(jnp.einsum("te,teh->th", combine, y) + m.shared_experts(x)))

    gs = jax.grad(sparse_loss, argnums=(0, 1))(params, x)
    gd = jax.grad(dense_loss, argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd), strict=True):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
    assert jnp.abs(gs[0]["gate"]["weight"][...]).max() > 0  # the router learns via gate values


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"n_group": 3}, "n_group"),
        ({"n_group": 8}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 5, "topk_group": 2}, "num_experts_per_tok"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"mlp_layer_types": ("dense", "moe")}, "mlp_layer_types"),
        ({"mlp_layer_types": ("dense",)}, "mlp_layer_types"),
    ],
)
def test_config_checks(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(BASE, **changes)
