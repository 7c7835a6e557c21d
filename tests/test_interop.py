"""jax_dsa.interop without transformers: config mapping, names, safetensors I/O, FP8
dequantisation, sharded loading on a CPU mesh, and the errors. (Parity with transformers itself
is tests/test_interop_hf.py.)"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import load_file, save_file

from jax_dsa.configs import DSAConfig, RopeParameters, get_config
from jax_dsa.interop import (
    config_from_hf,
    config_to_hf,
    load_hf,
    load_hf_attention,
    save_hf,
)
from jax_dsa.interop.safetensors_io import CheckpointReader, CheckpointWriter, parse_size
from jax_dsa.models.glm.hf_names import hf_key, is_ignored_key, layer_of
from jax_dsa.nn import DSALanguageModel
from jax_dsa.nn.experts import Buffer

TINY = dict(
    model_type="glm_moe_dsa", vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=4,
    index_n_heads=4, index_head_dim=8, initializer_range=0.2, max_position_embeddings=64,
    rope_parameters=RopeParameters(rope_theta=10000.0),
    mlp_layer_types=("dense", "sparse", "sparse"),
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    index_topk_freq=2, index_skip_topk_offset=1,
)


def _tiny(**kw) -> DSAConfig:
    return DSAConfig(**{**TINY, **kw})


def _model(config, seed=0):
    """A DSALanguageModel with NumPy-random weights (no per-initialiser compiles): linear
    weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.01), biases (the router's too) ~ N(0, 0.01)."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSALanguageModel(config, rngs=nnx.Rngs(0))))
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        name = str(path[-1])
        if name == "weight" and len(shape) == 1:
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            x = 0.1 * rng.standard_normal(shape)
        else:
            x = rng.standard_normal(shape) / np.sqrt(1 if path[0] == "embed_tokens" else shape[-1])
        flat.append((path, var.replace(jnp.asarray(x, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _flat(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


# -------------------------------------------------------------------------------------------
# Config mapping


@pytest.mark.parametrize("preset", ["glm5", "glm5.2", "deepseek-v3.2"])
def test_config_round_trip(preset):
    n = get_config(preset).num_hidden_layers
    c = get_config(preset, mlp_layer_types=("dense",) * 3 + ("sparse",) * (n - 3))
    hf = config_to_hf(c)
    assert json.loads(json.dumps(hf)) == hf
    back = config_from_hf(hf)
    assert back == dataclasses.replace(c, num_nextn_predict_layers=0)


def test_config_from_published_style_glm5():
    # The keys of zai-org/GLM-5's config.json that matter (no mlp_layer_types, no indexer_types).
    d = {
        "model_type": "glm_moe_dsa", "num_hidden_layers": 78, "first_k_dense_replace": 3,
        "hidden_size": 6144, "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128,
        "rope_theta": 1000000, "rope_scaling": None, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "num_nextn_predict_layers": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    }
    c = config_from_hf(d)
    assert c.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 75
    assert c.indexer_types == ("full",) * 78 and c.indexer_rope_interleave
    assert c.rope_parameters == RopeParameters(rope_theta=1e6) and c.softmax_scale == 1 / 16


def test_config_from_hf_follows_transformers_not_ignored_keys():
    base = config_to_hf(_tiny(model_type="deepseek_v32", indexer_rope_interleave=False,
                              indexer_types=("full",) * 3))
    with pytest.warns(UserWarning, match="indexer_rope_interleave"):
        c = config_from_hf({**base, "indexer_rope_interleave": True})
    assert not c.indexer_rope_interleave
    with pytest.warns(UserWarning, match="ignores indexer_types"):
        c = config_from_hf({**base, "indexer_types": ["full", "shared", "full"]})
    assert c.indexer_types == ("full",) * 3
    # YaRN without factor: max_position_embeddings / original_max_position_embeddings.
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 16}
    assert config_from_hf({**base, "rope_parameters": rope}).rope_parameters.factor == 4.0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "deepseek_v3"}, "model_type"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2}}, "rope_type"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_config_from_hf_errors(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**config_to_hf(_tiny()), **change})


@pytest.mark.parametrize(
    "config, match",
    [
        (_tiny(model_type="deepseek_v32", indexer_rope_interleave=False), "shared"),
        (_tiny(indexer_rope_interleave=False), "indexer_rope_interleave"),
        (_tiny(rope_interleave=False), "rope_interleave"),
        (_tiny(model_type="deepseek_v4"), "model_type"),
    ],
)
def test_config_to_hf_errors(config, match):
    with pytest.raises(ValueError, match=match):
        config_to_hf(config)


# -------------------------------------------------------------------------------------------
# Names and files


def test_names():
    assert hf_key(("layers", 2, "self_attn", "indexer", "wq_b", "weight")) == (
        "model.layers.2.self_attn.indexer.wq_b.weight", False)
    assert hf_key(("lm_head", "weight")) == ("lm_head.weight", False)
    assert hf_key(("layers", 1, "mlp", "experts", "down_proj")) == (
        "model.layers.1.mlp.experts.{expert}.down_proj.weight", True)
    assert hf_key(("q_a_proj", "weight"), "model.layers.4.self_attn.") == (
        "model.layers.4.self_attn.q_a_proj.weight", False)
    assert layer_of("model.layers.78.eh_proj.weight") == 78 and layer_of("lm_head.weight") is None
    assert is_ignored_key("model.layers.78.enorm.weight", 78)
    assert not is_ignored_key("model.layers.77.mlp.gate.weight", 78)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("64KiB") == 65536 and parse_size(7) == 7
    for bad in ("lots", "-1MB", 0):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_writer_shards_and_reader_slices(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((8, 5 + i)).astype(np.float32) for i in range(6)}
    tensors["bf"] = rng.standard_normal((3, 4)).astype(jnp.bfloat16)
    w = CheckpointWriter(tmp_path, max_shard_size=400)
    for k, v in tensors.items():
        w.add(k, v)
    with pytest.raises(ValueError, match="twice"):
        w.add("t0", tensors["t0"])
    files = w.finish()
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert sum(len(load_file(tmp_path / f)) for f in files) == len(tensors)
    with CheckpointReader(tmp_path) as r:
        for k, v in tensors.items():
            assert r.dtype(k) == ("BF16" if k == "bf" else "F32")
            np.testing.assert_array_equal(r.read(k), v)
            sl = (slice(1, 3), slice(2, 4))
            np.testing.assert_array_equal(r.read(k, sl), v[sl])


def _quantize_fp8(w, block):
    """Block-scaled e4m3 (DeepSeek-V3 ``weight_dequant`` convention): w ~ q * scale_inv."""
    b0, b1 = block
    nr, nc = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    scale = np.zeros((nr, nc), np.float32)
    q = np.zeros(w.shape, jnp.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            scale[i, j] = np.abs(blk).max() / 448.0
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / scale[i, j]).astype(q.dtype)
    return q, scale


def test_fp8_checkpoint_is_dequantised(tmp_path):
    config = _tiny()
    model = _model(config)
    save_hf(model, tmp_path)
    # Re-store two projections (one of them an expert's) as block-scaled FP8 with partial blocks.
    block = (8, 16)
    tensors = load_file(tmp_path / "model.safetensors")
    oracle = {}
    for key in ("model.layers.0.self_attn.q_b_proj.weight",
                "model.layers.1.mlp.experts.2.up_proj.weight"):
        q, scale = _quantize_fp8(tensors[key], block)
        tensors[key], tensors[key + "_scale_inv"] = q, scale
        rows = np.arange(q.shape[0]) // block[0]
        cols = np.arange(q.shape[1]) // block[1]
        # Exact in float64, then one rounding: what a float32 multiply gives.
        exact = q.astype(np.float64) * scale[rows[:, None], cols[None, :]]
        oracle[key] = exact.astype(np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "weight_block_size": list(block)}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = load_hf(tmp_path, dtype=jnp.float32)
    got_q = np.asarray(loaded.layers[0].self_attn.q_b_proj.weight[...])
    got_e = np.asarray(loaded.layers[1].mlp.experts.up_proj[...][2])
    np.testing.assert_array_equal(got_q, oracle["model.layers.0.self_attn.q_b_proj.weight"])
    np.testing.assert_array_equal(got_e, oracle["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert not np.array_equal(got_q, np.asarray(model.layers[0].self_attn.q_b_proj.weight[...]))
    # Slices (what each device reads on a mesh) dequantise like the whole.
    from jax_dsa.interop.reading import CheckpointSource

    key = "model.layers.0.self_attn.q_b_proj.weight"
    with CheckpointReader(tmp_path) as r:
        src = CheckpointSource(r, hf)
        full = src.read(key, (slice(0, None), slice(0, None)))
        for sl in [(slice(3, 17), slice(5, 16)), (slice(8, 16), slice(0, 1)),
                   (slice(0, 32), slice(15, 17))]:
            np.testing.assert_array_equal(src.read(key, sl), full[sl])


# -------------------------------------------------------------------------------------------
# Loading and saving


def test_save_then_load_is_exact_and_streams_shards(tmp_path):
    config = _tiny(tie_word_embeddings=False)
    model = _model(config, seed=3)
    files = save_hf(model, tmp_path, max_shard_size="20KB")
    assert len(files) > 2
    loaded = load_hf(tmp_path, dtype=jnp.float32)
    a, b = _flat(model), _flat(loaded)
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(a[p], b[p], err_msg=str(p))
    assert isinstance(loaded.layers[1].mlp.gate.e_score_correction_bias, Buffer)


def test_bfloat16_load_keeps_float32_islands(tmp_path):
    model = _model(_tiny())
    save_hf(model, tmp_path)
    loaded = load_hf(tmp_path)  # bfloat16 by default
    ref = _flat(model)
    for p, v in _flat(loaded).items():
        f32 = p[-2:] in {("weights_proj", "weight"), ("gate", "weight"),
                         ("gate", "e_score_correction_bias")} or p[-2] == "k_norm"
        assert v.dtype == (np.float32 if f32 else jnp.bfloat16), p
        np.testing.assert_array_equal(v, ref[p].astype(v.dtype), err_msg=str(p))


def test_load_hf_attention_alone(tmp_path):
    config = _tiny()
    model = _model(config)
    save_hf(model, tmp_path)
    for layer in range(config.num_hidden_layers):
        state = load_hf_attention(tmp_path, layer)
        want = nnx.state(model.layers[layer].self_attn)
        got = dict(nnx.to_flat_state(state))
        assert got.keys() == dict(nnx.to_flat_state(want)).keys()
        assert ("indexer", "wq_b", "weight") in got if config.has_indexer(layer) else all(
            p[0] != "indexer" for p in got)
        for p, v in nnx.to_flat_state(want):
            np.testing.assert_array_equal(np.asarray(got[p].get_value()), np.asarray(v.get_value()))
    with pytest.raises(ValueError, match="layer must be"):
        load_hf_attention(tmp_path, 3)


def test_load_errors(tmp_path):
    config = _tiny()
    save_hf(_model(config), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)

    def store(t):
        save_file(t, path, metadata={"format": "pt"})

    # MTP layers (layer index >= num_hidden_layers) are skipped.
    store({**tensors, "model.layers.3.eh_proj.weight": np.zeros((4, 4), np.float32)})
    load_hf(tmp_path, dtype=jnp.float32)
    store({**tensors, "model.layers.0.mlp.bogus.weight": np.zeros((4,), np.float32)})
    with pytest.raises(ValueError, match="belong to no supported layer.*bogus"):
        load_hf(tmp_path)
    missing = dict(tensors)
    del missing["model.layers.1.mlp.experts.3.gate_proj.weight"]
    store(missing)
    with pytest.raises(ValueError, match="lacks 1 tensors.*experts.3.gate_proj"):
        load_hf(tmp_path)
    bad = dict(tensors)
    bad["model.norm.weight"] = np.ones((33,), np.float32)
    store(bad)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_hf(tmp_path)
    os.remove(path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path / "nowhere")


def test_save_errors(tmp_path):
    model = _model(_tiny(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        save_hf(model, tmp_path)
    with pytest.raises(TypeError, match="DSALanguageModel"):
        save_hf(model.layers[0], tmp_path)


# -------------------------------------------------------------------------------------------
# Sharding


def test_load_on_a_mesh(tmp_path):
    """Parameters go straight to their NamedSharding (default rules and a custom table), with the
    same values and logits as a single-device load."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py asks XLA for 8 host devices)")
    save_hf(_model(_tiny()), tmp_path)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    plain = load_hf(tmp_path, dtype=jnp.float32)
    default = load_hf(tmp_path, dtype=jnp.float32, mesh=mesh)
    custom = load_hf(tmp_path, dtype=jnp.float32, mesh=mesh,
                     rules=(("heads", "tp"), ("experts", "dp"), ("mlp", "tp"), ("embed", None)))
    ref = _flat(plain)

    def specs(model):
        out = {}
        for p, v in nnx.to_flat_state(nnx.state(model)):
            x = v.get_value()
            assert x.sharding.mesh.shape == mesh.shape
            np.testing.assert_array_equal(np.asarray(x), ref[p], err_msg=str(p))
            out[".".join(map(str, p))] = tuple(x.sharding.spec) + (None,) * (x.ndim - len(
                x.sharding.spec))
        return out

    d, c = specs(default), specs(custom)
    assert d["layers.0.self_attn.q_b_proj.weight"] == ("tp", None)
    assert d["layers.0.self_attn.o_proj.weight"] == (None, "tp")
    assert d["layers.1.mlp.experts.gate_proj"] == (None, "tp", None)
    assert d["embed_tokens.weight"] == ("tp", None)
    assert d["layers.0.self_attn.indexer.wq_b.weight"] == (None, None)
    assert c["layers.1.mlp.experts.down_proj"] == ("dp", None, "tp")
    assert c["embed_tokens.weight"] == (None, None)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    f = nnx.jit(lambda m, i: m(i, compute_indexer_loss=False)[0])
    np.testing.assert_allclose(np.asarray(f(custom, ids)), np.asarray(f(plain, ids)),
                               rtol=1e-5, atol=1e-5)
