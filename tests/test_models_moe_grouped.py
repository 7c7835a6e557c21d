"""The MoE layers of both families on ``grouped_matmul`` (jax_dsa.nn.experts): the mix against a
float64 NumPy oracle and against the previous ``jax.lax.ragged_dot`` + scatter-add formulation
(forward and gradients; GLM, V4 hash and top-k, experts that receive no token), the expert load
in the aux values, DeepSeek-V3's router bias update (and examples/train.py applying it), the
full-size presets' MoE layout against ``from_hf_dict`` of the real configs, and (GPU) ``"cuda"``
against ``"xla"`` at GLM-5's expert dims."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.configs import DSAConfig, get_config
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.models.deepseek_v4.moe import DeepseekV4MoE
from jax_dsa.models.glm.model import DecoderLayer, DSALanguageModel
from jax_dsa.models.glm.moe import MoE
from jax_dsa.nn import experts as experts_mod
from jax_dsa.nn.experts import (
    Experts,
    moe_blocks,
    router_bias_step,
    update_router_biases,
)

GLM = DSAConfig(
    hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    v_head_dim=4, index_topk=4, index_n_heads=2, index_head_dim=4, vocab_size=32,
    mlp_layer_types=("dense", "sparse"), moe_intermediate_size=6, n_routed_experts=8,
    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
)


def _old_mix(x, topk_weights, topk_indices, gate_proj, up_proj, down_proj, *, n_experts,
             limit=None, implementation=None):
    """The formulation before grouped_matmul: ragged_dot on transposed copies, scatter-add."""
    t, k = topk_indices.shape
    flat = topk_indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    xs = x[token]
    gate = jax.lax.ragged_dot(xs, jnp.swapaxes(gate_proj, 1, 2), group_sizes)
    up = jax.lax.ragged_dot(xs, jnp.swapaxes(up_proj, 1, 2), group_sizes)
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    h = jax.nn.silu(gate) * up
    y = jax.lax.ragged_dot(h, jnp.swapaxes(down_proj, 1, 2), group_sizes)
    y = y * topk_weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((t, x.shape[-1]), y.dtype).at[token].add(y), group_sizes


def _np_mix(x, w, idx, gp, up, dp, limit=None):
    x, w, gp, up, dp = (np.asarray(a, np.float64) for a in (x, w, gp, up, dp))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(idx)[t]):
            g, u = gp[e] @ x[t], up[e] @ x[t]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += w[t, j] * (dp[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def _routing(rng, t, k, e, used):
    """Distinct experts per token drawn from the first ``used`` of ``e`` (the rest get none)."""
    idx = np.stack([rng.choice(used, k, replace=False) for _ in range(t)]).astype(np.int32)
    return jnp.asarray(idx), jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)


def _weights(rng, e, i, h):
    return tuple(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-1]), jnp.float32)
                 for s in ((e, i, h), (e, i, h), (e, h, i)))


@pytest.mark.parametrize("limit", [None, 0.7])
def test_mix_matches_float64_oracle_and_ragged_dot(limit):
    """Forward against float64 NumPy; forward and every gradient against the ragged_dot +
    scatter-add formulation; experts 5..7 receive no token; the load is the bincount."""
    rng = np.random.default_rng(0)
    t, k, e, i, h = 11, 3, 8, 6, 16
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    idx, w = _routing(rng, t, k, e, used=5)
    ws = _weights(rng, e, i, h)
    new = jax.jit(lambda *a: experts_mod._mix(*a, n_experts=e, limit=limit))
    y, load = new(x, w, idx, *ws)
    np.testing.assert_allclose(np.asarray(y), _np_mix(x, w, idx, *ws, limit=limit),
                               rtol=1e-5, atol=1e-5)
    assert load.dtype == jnp.int32
    np.testing.assert_array_equal(load, np.bincount(np.asarray(idx).ravel(), minlength=e))
    assert not np.asarray(load)[5:].any()

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(fn(*a[:2], idx, *a[2:], n_experts=e, limit=limit)[0]))

    args = (x, w, *ws)
    g_new = jax.jit(jax.grad(loss(experts_mod._mix), argnums=range(5)))(*args)
    g_old = jax.jit(jax.grad(loss(_old_mix), argnums=range(5)))(*args)
    for a, b in zip(g_new, g_old, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not np.asarray(g_new[2])[5:].any()  # no token: no weight gradient
    assert np.abs(np.asarray(g_new[2])[:5]).max() > 0


def test_out_of_range_expert_ids_are_invalid_slots():
    """An expert index below 0 or at least E adds nothing and is not counted in the load,
    whatever its integer type; the valid slots' outputs and gradients are unchanged."""
    rng = np.random.default_rng(3)
    t, k, e, i, h = 6, 2, 4, 5, 8
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    idx, w = _routing(rng, t, k, e, used=e)
    bad = np.array(idx)
    bad[0, 0], bad[2, 1], bad[4, 0] = -1, e, -7
    keep = (bad >= 0) & (bad < e)
    ws = _weights(rng, e, i, h)
    w_valid = jnp.where(jnp.asarray(keep), w, 0.0)  # an invalid slot is a slot of weight 0
    for dtype in (jnp.int32, jnp.int64, jnp.uint32):
        ids = jnp.asarray(bad.astype(np.dtype(dtype)) if dtype != jnp.uint32
                          else bad.astype(np.int64).astype(np.uint32))
        mix = jax.jit(lambda x, w, *ws, ids=ids: experts_mod._mix(x, w, ids, *ws, n_experts=e))
        y, load = mix(x, w, *ws)
        np.testing.assert_allclose(np.asarray(y), _np_mix(x, w_valid, idx, *ws),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(load, np.bincount(bad[keep], minlength=e))
        g = jax.grad(lambda x, ids=ids: jnp.sum(experts_mod._mix(x, w, ids, *ws,
                                                                  n_experts=e)[0]))(x)
        g_ref = jax.grad(lambda x: jnp.sum(experts_mod._mix(x, w_valid, idx, *ws,
                                                             n_experts=e)[0]))(x)
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)


def test_moe_block_checks_the_routing_fields_without_mlp_layer_types():
    c = dataclasses.replace(GLM, mlp_layer_types=None, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds"):
        MoE(c, rngs=nnx.Rngs(0))


def test_mix_bfloat16_matches_ragged_dot():
    rng = np.random.default_rng(1)
    t, k, e, i, h = 16, 2, 4, 8, 16
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    idx, w = _routing(rng, t, k, e, used=3)
    ws = tuple(a.astype(jnp.bfloat16) for a in _weights(rng, e, i, h))
    y, _ = experts_mod._mix(x, w, idx, *ws, n_experts=e)
    y_old, _ = _old_mix(x, w, idx, *ws, n_experts=e)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_old, np.float32),
                               rtol=2e-2, atol=2e-2)


def _randomize(module, seed, bias_scale=0.3):
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(module)):
        v = var.get_value()
        if jnp.issubdtype(v.dtype, jnp.floating):
            scale = bias_scale if path[-1] == "e_score_correction_bias" else v.shape[-1] ** -0.5
            var.set_value(jnp.asarray(rng.standard_normal(v.shape) * scale, v.dtype))


def _v4_config():
    return get_config("deepseek-v4-tiny", hidden_size=16, moe_intermediate_size=8, vocab_size=32,
                      n_routed_experts=6, num_experts_per_tok=2, swiglu_limit=0.5)


BLOCKS = {
    "glm": lambda: MoE(GLM, rngs=nnx.Rngs(0)),
    "v4-hash": lambda: DeepseekV4MoE(_v4_config(), 0, rngs=nnx.Rngs(0)),
    "v4-topk": lambda: DeepseekV4MoE(_v4_config(), 1, rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_matches_ragged_dot_and_returns_load(name, monkeypatch):
    """A whole MoE block (router, experts, shared expert): output and gradients (parameters and
    input) through grouped_matmul equal the ragged_dot formulation's; the load equals a NumPy
    bincount of the router's choice; some experts get no token."""
    block = BLOCKS[name]()
    _randomize(block, 3)
    hidden = block.config.hidden_size
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3, hidden)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 3, (2, 3)), jnp.int32)  # the hash table's first rows
    call = ((lambda m, x: m(x, return_load=True)) if name == "glm"
            else (lambda m, x: m(x, ids, return_load=True)))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def run(params, x):
        out, load = call(nnx.merge(graphdef, params, rest), x)
        return jnp.sum(jnp.sin(out)), (out, load)

    step = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))
    (_, (out, load)), grads = step(params, x)
    monkeypatch.setattr(experts_mod, "_mix", _old_mix)
    (_, (out_old, load_old)), grads_old = jax.jit(
        jax.value_and_grad(run, argnums=(0, 1), has_aux=True))(params, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_old), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_old), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    flat = x.reshape(-1, hidden)
    _, idx = block.gate(flat) if name == "glm" else block.gate(flat, ids.reshape(-1))
    want = np.bincount(np.asarray(idx).ravel(), minlength=block.config.n_routed_experts)
    np.testing.assert_array_equal(load, want)
    np.testing.assert_array_equal(load_old, want)
    assert load.shape == (block.config.n_routed_experts,) and load.dtype == jnp.int32
    assert (want == 0).any()  # 6 tokens x k slots leave some expert without a token


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_with_no_tokens(name):
    """A MoE block given zero tokens: a [.., 0, hidden] output, an all-zero load, and zero
    gradients (nothing computed, nothing exchanged)."""
    block = BLOCKS[name]()
    x = jnp.zeros((1, 0, block.config.hidden_size), jnp.float32)
    ids = jnp.zeros((1, 0), jnp.int32)
    call = ((lambda m, x: m(x, return_load=True)) if name == "glm"
            else (lambda m, x: m(x, ids, return_load=True)))
    graphdef, params, rest = nnx.split(block, nnx.Param, ...)

    def run(params, x):
        out, load = call(nnx.merge(graphdef, params, rest), x)
        return jnp.sum(out), (out, load)

    (_, (out, load)), grads = jax.jit(jax.value_and_grad(run, has_aux=True))(params, x)
    assert out.shape == x.shape
    np.testing.assert_array_equal(load, np.zeros(block.config.n_routed_experts, np.int32))
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads))


def test_load_under_explicit_token_sharding():
    """On an Explicit mesh the experts run per token shard (shard_map); the load is summed over
    the shards and the output equals the unsharded one."""
    rng = np.random.default_rng(5)
    ex = Experts(GLM, rngs=nnx.Rngs(0))
    t, k = 8, GLM.num_experts_per_tok
    x = jnp.asarray(rng.standard_normal((t, GLM.hidden_size)), jnp.float32)
    idx, w = _routing(rng, t, k, GLM.n_routed_experts, used=6)
    want, want_load = ex(x, w, idx, return_load=True)
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        shard = NamedSharding(mesh, P("dp", None))
        got, load = nnx.jit(lambda e, *a: e(*a, return_load=True))(
            ex, *(jax.device_put(a, shard) for a in (x, w, idx)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(load, want_load)


def test_models_return_expert_load_per_moe_layer():
    """aux["expert_load"]: one [E] int32 per MoE layer (GLM: the "sparse" layers only; V4: every
    layer), each summing to tokens x k, in moe_blocks order."""
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 256, (2, 16)), jnp.int32)
    glm = get_config("glm5-tiny", mlp_layer_types=("dense", "sparse"))
    model = DSALanguageModel(glm, rngs=nnx.Rngs(0))
    _, aux = nnx.jit(lambda m, i: m(i, attention_mode="dense"))(model, ids)
    assert len(aux["expert_load"]) == len(moe_blocks(model)) == 1
    (load,) = aux["expert_load"]
    assert load.shape == (glm.n_routed_experts,) and load.dtype == jnp.int32
    assert int(load.sum()) == ids.size * glm.num_experts_per_tok
    v4 = get_config("deepseek-v4-tiny", num_hidden_layers=2)
    model = DeepseekV4LanguageModel(v4, rngs=nnx.Rngs(0))
    _, aux = nnx.jit(lambda m, i: m(i, attention_mode="dense"))(model, ids)
    assert len(aux["expert_load"]) == len(moe_blocks(model)) == 2
    for load in aux["expert_load"]:
        assert int(load.sum()) == ids.size * v4.num_experts_per_tok


def test_router_bias_step_direction():
    bias = jnp.zeros(4, jnp.float32)
    new = router_bias_step(bias, jnp.asarray([10, 2, 0, 4], jnp.int32), 0.001)
    np.testing.assert_allclose(np.asarray(new), [-0.001, 0.001, 0.001, 0.0])
    # V4: the hash layer has no bias and is skipped; the top-k layers move
    model = nnx.eval_shape(lambda: DeepseekV4LanguageModel(
        get_config("deepseek-v4-tiny"), rngs=nnx.Rngs(0)))
    e = model.config.n_routed_experts
    for block in moe_blocks(model):
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.set_value(jnp.zeros(e, jnp.float32))
    loads = [jnp.arange(e, dtype=jnp.int32)] * len(moe_blocks(model))
    assert update_router_biases(model, loads, 0.5) == 3  # layers 1-3; layer 0 is hash-routed
    with pytest.raises(ValueError, match="expert loads"):
        update_router_biases(model, loads[:1], 0.5)


def _load_train():
    examples = pathlib.Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    spec = importlib.util.spec_from_file_location("jax_dsa_example_train_moe",
                                                  examples / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_train_bias_update_balances_a_skewed_router():
    """examples/train.py's step + balance_router_biases on a one-MoE-layer tiny GLM whose router
    bias sends every token to experts 0 and 1: after each step the overloaded experts' biases go
    down and the idle ones' up by --bias-update-rate (the parameters are untouched by it)."""
    train = _load_train()
    import text_data

    rate = 0.25
    args = train.parse_args(["--model", "glm5-tiny", "--batch", "2", "--seq-len", "64",
                             "--bias-update-rate", str(rate)])
    assert args.bias_update_rate == rate and train.parse_args([]).bias_update_rate == 0.001
    config = get_config("glm5-tiny", mlp_layer_types=("dense", "sparse"), num_hidden_layers=2)
    model = DSALanguageModel(config, rngs=nnx.Rngs(0))
    model.layers[1].mlp.gate.e_score_correction_bias.set_value(
        jnp.asarray([1.0, 1.0, 0.0, 0.0], jnp.float32))
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    mesh = train.make_mesh({"dp": 1})
    param_sharding = train.param_shardings(mesh, param_state)
    params = jax.tree.map(train.global_array, nnx.to_pure_dict(param_state), param_sharding)
    batch_sharding = NamedSharding(mesh, train.logical_to_mesh(("batch", "sequence"), mesh=mesh))
    steps = train.get_steps(graphdef, params, train.OptimizerSettings.from_args(args), mesh,
                            implementation=None, indexer_loss_coeff=1.0,
                            param_sharding=param_sharding, batch_sharding=batch_sharding)
    balance = jax.jit(lambda p, r, load, rate: train.balance_router_biases(
        graphdef, p, r, load, rate))
    rng = np.random.default_rng(0)
    rows = text_data.pack_documents(
        [rng.integers(0, 256, 200, dtype=np.uint8).tobytes()], 64)
    batch = train.place_batch(text_data.make_batch(rows, np.arange(2)), batch_sharding)
    opt_state = steps.init_opt_state(params)

    def bias(r):
        return np.asarray(r["layers"][1]["mlp"]["gate"]["e_score_correction_bias"][...])

    with jax.set_mesh(mesh):
        for _ in range(2):
            before = bias(rest)
            params, opt_state, stats = steps.train("dense", params, rest, opt_state, batch)
            stats = jax.device_get(stats)
            (load,) = stats["expert_load"]
            assert load.sum() == 2 * 64 * config.num_experts_per_tok
            assert int(stats["expert_overflow"]) == 0  # no expert parallelism: nothing dropped
            p_before = [np.array(a) for a in jax.tree.leaves(params)]
            rest = balance(params, rest, stats["expert_load"], rate)
            np.testing.assert_allclose(bias(rest) - before,
                                       rate * np.sign(load.mean() - load), atol=1e-6)
            for a, b in zip(p_before, jax.tree.leaves(params)):
                np.testing.assert_array_equal(a, np.asarray(b))
    assert load[:2].sum() > load[2:].sum()  # skewed at the start ...
    np.testing.assert_allclose(bias(rest), [0.5, 0.5, 0.5, 0.5], atol=1e-6)  # ... now even


# Full-size presets: the MoE layout from_hf_dict builds from the released config.json -----------

# The MoE-relevant keys of the released checkpoints' config.json (zai-org/GLM-5, zai-org/GLM-5.2,
# deepseek-ai/DeepSeek-V3.2-Exp), as in tests/test_interop.py and tests/test_configs.py.
_GLM5_HF = {
    "model_type": "glm_moe_dsa", "num_hidden_layers": 78, "first_k_dense_replace": 3,
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1,
    "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "index_topk": 2048,
    "index_n_heads": 32, "index_head_dim": 128, "rope_theta": 1000000, "rope_scaling": None,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "num_nextn_predict_layers": 1, "vocab_size": 154880,
}
HF_DICTS = {
    "glm5": _GLM5_HF,
    "glm5.2": dict(_GLM5_HF, index_topk_freq=4, index_skip_topk_offset=3,
                   rope_parameters={"rope_theta": 8000000, "rope_type": "default"},
                   max_position_embeddings=1048576),
    "deepseek-v3.2": {
        "model_type": "deepseek_v32", "num_hidden_layers": 61, "first_k_dense_replace": 3,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
        "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "vocab_size": 129280,
    },
}
MOE_FIELDS = ("mlp_layer_types", "first_k_dense_replace", "intermediate_size",
              "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
              "num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor",
              "norm_topk_prob", "scoring_func", "topk_method")


@pytest.mark.parametrize("name", sorted(HF_DICTS))
def test_glm_presets_build_the_real_moe_layers(name):
    c, hf = get_config(name), DSAConfig.from_hf_dict(HF_DICTS[name])
    assert {f: getattr(c, f) for f in MOE_FIELDS} == {f: getattr(hf, f) for f in MOE_FIELDS}
    assert c.mlp_layer_types == ("dense",) * 3 + ("sparse",) * (c.num_hidden_layers - 3)
    # the layers the model builds, abstractly (no memory): dense MLP, then 256 experts
    dense = nnx.eval_shape(lambda: DecoderLayer(c, 2, rngs=nnx.Rngs(0)))
    sparse = nnx.eval_shape(lambda: DecoderLayer(c, 3, rngs=nnx.Rngs(0)))
    assert not hasattr(dense.mlp, "experts")
    assert dense.mlp.gate_proj.weight.shape == (c.intermediate_size, c.hidden_size)
    assert sparse.mlp.experts.gate_proj.shape == (256, 2048, c.hidden_size)
    assert sparse.mlp.experts.down_proj.shape == (256, c.hidden_size, 2048)
    assert sparse.mlp.shared_experts.gate_proj.weight.shape == (2048, c.hidden_size)
    # a shallower preset keeps the dense-then-MoE schedule; the tiny ones stay dense
    assert get_config(name, num_hidden_layers=5).mlp_layer_types == (
        "dense",) * 3 + ("sparse",) * 2
    assert get_config(f"{name}-tiny").mlp_layer_types is None


def test_v4_presets_build_the_real_moe_layers():
    from test_models_deepseek_v4_config import FLASH_CONFIG_JSON

    pro_json = dict(
        FLASH_CONFIG_JSON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        q_lora_rank=1536, o_groups=16, index_topk=1024, moe_intermediate_size=3072,
        n_routed_experts=384, routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0])
    fields = MOE_FIELDS[:1] + ("moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                               "num_experts_per_tok", "scoring_func", "routed_scaling_factor",
                               "swiglu_limit")
    for name, d in (("deepseek-v4-flash", FLASH_CONFIG_JSON), ("deepseek-v4-pro", pro_json)):
        c, hf = get_config(name), DeepseekV4Config.from_hf_dict(d)
        assert {f: getattr(c, f) for f in fields} == {f: getattr(hf, f) for f in fields}
        assert c.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * (c.num_hidden_layers - 3)


def test_train_checks_the_expert_flags():
    """examples/train.py refuses, before building anything, a capacity factor that is not a
    finite number > 0, an ep that does not divide the experts, and the ragged exchange on the
    host (XLA:CPU has no ragged all-to-all)."""
    train = _load_train()
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(SystemExit):
            train.parse_args(["--expert-capacity-factor", bad])
    n = get_config("glm5-tiny").n_routed_experts
    with pytest.raises(ValueError,
                       match=rf"--mesh ep=3 must divide the model's n_routed_experts \({n}"):
        train.main(["--model", "glm5-tiny", "--mesh", "ep=3"])
    with pytest.raises(ValueError, match="--expert-dispatch ragged needs GPUs or TPUs"):
        train.main(["--model", "glm5-tiny", "--mesh", "ep=2", "--expert-dispatch", "ragged"])


# GPU: "cuda" against "xla" at GLM-5's and DeepSeek-V4-Flash's expert dims -------------------


def _glm5_block():
    c = dataclasses.replace(get_config("glm5"), n_routed_experts=8, num_experts_per_tok=2,
                            n_group=1, topk_group=1, num_hidden_layers=4,
                            mlp_layer_types=("sparse",) * 4, indexer_types=None)
    return MoE(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _v4_flash_block(layer_idx):
    c = get_config("deepseek-v4-flash", n_routed_experts=16)  # top-6, SwiGLU clip
    return DeepseekV4MoE(c, layer_idx, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                         param_dtype=jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["glm5", "v4-flash-hash", "v4-flash-topk"])
def test_cuda_moe_matches_xla_at_model_dims(name):
    """A MoE block at the model's expert dims (GLM-5: hidden 6144, moe_intermediate 2048, 8
    experts, top-2; DeepSeek-V4-Flash: hidden 4096, moe_intermediate 2048, 16 experts, top-6,
    its hash-routed first layer and a top-k layer), 1024 tokens, bfloat16: output and gradients
    on "cuda" equal "xla" within bf16 tolerance, and the loads are equal."""
    moe = {"glm5": _glm5_block, "v4-flash-hash": lambda: _v4_flash_block(0),
           "v4-flash-topk": lambda: _v4_flash_block(3)}[name]()
    c = moe.config
    graphdef, params, rest = nnx.split(moe, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (1024, c.hidden_size), jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(2), (1024,), 0, c.vocab_size, jnp.int32)
    kw = {"input_ids": ids} if name.startswith("v4") else {}

    def run(impl):
        def loss(params, x):
            out, load = nnx.merge(graphdef, params, rest)(x, implementation=impl,
                                                          return_load=True, **kw)
            return jnp.sum(out.astype(jnp.float32) ** 2), (out, load)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (_, (out_c, load_c)), g_c = run("cuda")
    (_, (out_x, load_x)), g_x = run("xla")
    np.testing.assert_array_equal(load_c, load_x)

    def rel(a, b):
        a, b = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (a, b))
        return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

    assert rel(out_c, out_x) <= 2e-2
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_x), strict=True):
        assert rel(a, b) <= 2e-2
