"""Tests for jax_dsa.configs: preset dimensions (the published checkpoints' config.json), derived
quantities, the GLM-5.2 IndexShare schedule, HF dict conversion and validation."""

import dataclasses
import math

import pytest

from jax_dsa.configs import (
    PRESET_NAMES,
    DSAConfig,
    RopeParameters,
    get_config,
    indexer_schedule,
    yarn_get_mscale,
)


def test_glm5_small_fits_the_gpu_kernels():
    c = get_config("glm5-small")
    assert (c.d_qk, c.d_v) == (576, 512) and c.softmax_scale == (64 + 64) ** -0.5
    assert c.index_head_dim == 128 and c.index_n_heads <= 64  # the indexer kernels' widths
    assert c.full_indexer_layers == tuple(range(c.num_hidden_layers))


def test_preset_names():
    assert set(PRESET_NAMES) == {
        "glm5", "glm5.2", "deepseek-v3.2", "glm5-tiny", "glm5.2-tiny", "deepseek-v3.2-tiny",
        "glm5-small",
    }
    with pytest.raises(KeyError, match="unknown preset"):
        get_config("glm6")


@pytest.mark.parametrize("name", ["glm5", "glm5.2"])
def test_glm5_dimensions(name):
    c = get_config(name)
    assert c.model_type == "glm_moe_dsa"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (6144, 78, 64)
    assert (c.q_lora_rank, c.kv_lora_rank) == (2048, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (192, 64, 256)
    assert (c.d_qk, c.d_v, c.qk_head_dim) == (576, 512, 256)
    assert c.softmax_scale == 1 / 16
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
    assert c.vocab_size == 154880 and c.rms_norm_eps == 1e-5
    assert c.rope_interleave and c.indexer_rope_interleave
    assert c.rope_parameters.rope_type == "default"
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (256, 8, 1)
    assert c.routed_scaling_factor == 2.5 and c.first_k_dense_replace == 3
    if name == "glm5":
        assert c.rope_theta == 1e6 and c.max_position_embeddings == 202752
        assert c.full_indexer_layers == tuple(range(78))
    else:
        assert c.rope_theta == 8e6 and c.max_position_embeddings == 1048576


def test_glm52_indexshare_schedule():
    c = get_config("glm5.2")
    expected = (0, 1, 2) + tuple(range(6, 75, 4))
    assert c.full_indexer_layers == expected
    assert expected[-1] == 74 and len(expected) == 21
    assert len(c.shared_indexer_layers) == 78 - 21
    # The rule, written out: full iff max(i + 1 - offset, 0) % freq == 0 (freq 4, offset 3).
    for i in range(78):
        assert c.has_indexer(i) == (max(i + 1 - 3, 0) % 4 == 0)


def test_deepseek_v32_dimensions():
    c = get_config("deepseek-v3.2")
    assert c.model_type == "deepseek_v32"
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (7168, 61, 128)
    assert (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.d_qk, c.d_v) == (576, 512)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 2048)
    assert c.rope_interleave and not c.indexer_rope_interleave
    p = c.rope_parameters
    assert (p.rope_type, p.factor, p.original_max_position_embeddings) == ("yarn", 40, 4096)
    assert (p.rope_theta, p.beta_fast, p.beta_slow) == (10000, 32, 1)
    assert c.max_position_embeddings == 163840 and c.vocab_size == 129280
    mscale = 0.1 * math.log(40) + 1
    assert math.isclose(c.softmax_scale, 192**-0.5 * mscale**2, rel_tol=1e-15)
    assert math.isclose(c.softmax_scale, 0.13523, rel_tol=1e-4)  # models.md: ~0.1352
    assert p.cos_sin_scale == 1.0  # mscale == mscale_all_dim: no cos/sin factor
    assert c.full_indexer_layers == tuple(range(61))


def test_tiny_presets():
    g = get_config("glm5-tiny")
    assert (g.vocab_size, g.hidden_size, g.num_hidden_layers) == (256, 128, 2)
    assert (g.num_attention_heads, g.q_lora_rank, g.kv_lora_rank) == (4, 64, 64)
    assert (g.qk_nope_head_dim, g.qk_rope_head_dim) == (32, 16)
    assert (g.v_head_dim, g.index_n_heads, g.index_head_dim, g.index_topk) == (32, 4, 32, 64)
    assert (g.d_qk, g.d_v) == (80, 64) and g.indexer_rope_interleave
    g2 = get_config("glm5.2-tiny")
    assert g2.full_indexer_layers == (0, 2) and g2.shared_indexer_layers == (1, 3)
    d = get_config("deepseek-v3.2-tiny")
    assert not d.indexer_rope_interleave and d.rope_parameters.rope_type == "yarn"
    assert math.isclose(d.softmax_scale, 48**-0.5 * (0.1 * math.log(4) + 1) ** 2, rel_tol=1e-15)


def test_schedule_function_and_override():
    assert indexer_schedule(5) == ("full",) * 5  # HF defaults freq 1, offset 2
    assert indexer_schedule(6, 2, 1) == ("full", "shared") * 3
    c = get_config("glm5.2-tiny", num_hidden_layers=6)
    assert c.full_indexer_layers == (0, 2, 4)
    explicit = get_config("glm5-tiny", indexer_types=("full", "shared"))
    assert explicit.shared_indexer_layers == (1,)


def test_hashable_and_frozen():
    c = get_config("glm5.2-tiny")
    assert hash(c) == hash(dataclasses.replace(c))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 3


def test_yarn_mscale():
    assert yarn_get_mscale(1.0, 5.0) == 1.0
    assert math.isclose(yarn_get_mscale(40, 0.707), 0.1 * 0.707 * math.log(40) + 1)
    p = RopeParameters(
        rope_type="yarn", factor=8, original_max_position_embeddings=64, mscale=1.0,
        mscale_all_dim=0.5,
    )
    assert math.isclose(p.cos_sin_scale, yarn_get_mscale(8, 1.0) / yarn_get_mscale(8, 0.5))
    assert math.isclose(p.softmax_mscale, yarn_get_mscale(8, 0.5) ** 2)
    plain = RopeParameters(rope_type="yarn", factor=8, original_max_position_embeddings=64)
    assert math.isclose(plain.cos_sin_scale, yarn_get_mscale(8)) and plain.softmax_mscale == 1.0


def test_from_hf_dict_deepseek_v32():
    # The fields of deepseek-ai/DeepSeek-V3.2-Exp config.json that matter here (old rope_scaling).
    d = {
        "model_type": "deepseek_v32", "hidden_size": 7168, "index_head_dim": 128,
        "index_n_heads": 64, "index_topk": 2048, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "num_attention_heads": 128,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "v_head_dim": 128, "vocab_size": 129280, "n_group": 8,
        "topk_group": 4, "quantization_config": {"fmt": "e4m3"},
    }
    c = DSAConfig.from_hf_dict(d)
    ref = get_config("deepseek-v3.2")
    assert c.softmax_scale == ref.softmax_scale and c.rope_parameters == ref.rope_parameters
    assert not c.indexer_rope_interleave and c.d_qk == 576


def test_from_hf_dict_glm52():
    d = {
        "model_type": "glm_moe_dsa", "num_hidden_layers": 78, "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
        "rope_interleave": True, "indexer_rope_interleave": True,
        "max_position_embeddings": 1048576,
    }
    c = DSAConfig.from_hf_dict(d)
    assert c.full_indexer_layers == get_config("glm5.2").full_indexer_layers
    assert c.rope_theta == 8e6
    pattern = DSAConfig.from_hf_dict({"num_hidden_layers": 3, "index_topk_pattern": "FSF"})
    assert pattern.indexer_types == ("full", "shared", "full")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(indexer_types=("shared", "full")), "layer 0"),
        (dict(indexer_types=("full",)), "indexer_types has 1"),
        (dict(indexer_types=("full", "sparse")), "entries must be"),
        (dict(qk_rope_head_dim=15), "even"),
        (dict(qk_rope_head_dim=64), "index_head_dim"),
        (dict(num_attention_heads=0), "num_attention_heads"),
    ],
)
def test_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        get_config("glm5-tiny", **overrides)


def test_rope_parameters_validation():
    with pytest.raises(ValueError, match="rope_type"):
        RopeParameters(rope_type="longrope")
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeParameters(rope_type="yarn", factor=4.0)
