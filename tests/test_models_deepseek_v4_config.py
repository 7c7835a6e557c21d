"""Tests for jax_dsa.models.deepseek_v4.config: V4-Flash / V4-Pro dimensions (the published
checkpoints' config.json), layer schedules, RoPE per layer type, HF dict conversion, get_config
dispatch and validation."""

from __future__ import annotations

import dataclasses

import pytest

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.config import (
    CSA,
    HCA,
    PRESET_NAMES,
    SLIDING,
    DeepseekV4Config,
    default_layer_types,
    default_mlp_layer_types,
    get_v4_config,
    layer_types_from_ratios,
)

# The attention part of DeepSeek-V4-Flash's config.json (deepseek-ai, as mirrored publicly).
FLASH_CONFIG_JSON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "o_lora_rank": 1024, "o_groups": 8, "qk_rope_head_dim": 64, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "index_topk": 512, "index_n_heads": 64, "index_head_dim": 128,
    "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "num_hash_layers": 3, "swiglu_limit": 10.0, "vocab_size": 129280,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_presets_are_found_by_get_config():
    assert set(PRESET_NAMES) == {"deepseek-v4-flash", "deepseek-v4-pro", "deepseek-v4-tiny"}
    for name in PRESET_NAMES:
        assert isinstance(get_config(name), DeepseekV4Config)
    with pytest.raises(KeyError, match="deepseek-v4-tiny"):  # the message lists V4 names too
        get_config("deepseek-v5")


def test_flash_dimensions():
    c = get_config("deepseek-v4-flash")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (4096, 43, 64)
    assert (c.head_dim, c.qk_rope_head_dim, c.q_lora_rank) == (512, 64, 1024)
    assert (c.o_groups, c.o_lora_rank, c.sliding_window) == (8, 1024, 128)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert (c.d_qk, c.d_v) == (512, 512) and c.softmax_scale == 512**-0.5
    assert c.compress_ratios == (0, 0) + (4, 128) * 20 + (4,)
    assert [c.layer_types.count(t) for t in (SLIDING, CSA, HCA)] == [2, 21, 20]
    assert c.rope_parameters.rope_theta == 10000 and c.rope_parameters.rope_type == "default"
    rp = c.compress_rope_parameters
    assert (rp.rope_type, rp.rope_theta, rp.factor) == ("yarn", 160000, 16)
    assert rp.original_max_position_embeddings == 65536
    assert rp.cos_sin_scale == 1.0 and rp.softmax_mscale == 1.0  # no YaRN scale (transformers)
    assert c.rope_parameters_for(SLIDING) is not rp and c.rope_parameters_for(CSA) == rp
    assert c.indexer_weight_scale == 64**-0.5 * 128**-0.5
    assert c.intermediate_size == c.moe_intermediate_size == 2048


def test_pro_dimensions():
    c = get_config("deepseek-v4-pro")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (7168, 61, 128)
    assert (c.q_lora_rank, c.o_groups, c.index_topk) == (1536, 16, 1024)
    assert c.compress_ratios == (128, 128) + (4, 128) * 29 + (4,)
    assert [c.layer_types.count(t) for t in (SLIDING, CSA, HCA)] == [0, 30, 31]
    assert (c.n_routed_experts, c.moe_intermediate_size, c.intermediate_size) == (384, 3072, 3072)


def test_tiny_has_every_layer_type():
    c = get_config("deepseek-v4-tiny")
    assert set(c.layer_types) == {SLIDING, CSA, HCA} and c.vocab_size == 256
    assert c.compress_ratios == (0, 4, 16, 4)
    c6 = get_v4_config("deepseek-v4-tiny", num_hidden_layers=6)
    assert c6.layer_types == c.layer_types + default_layer_types(6)[4:]


def test_from_checkpoint_config_json():
    c = DeepseekV4Config.from_hf_dict(FLASH_CONFIG_JSON)
    assert c == get_config("deepseek-v4-flash")  # MTP ratio dropped, YaRN on compressed layers


def test_transformers_dict_round_trip():
    for name in PRESET_NAMES:
        c = get_config(name)
        assert DeepseekV4Config.from_hf_dict(c.to_hf_dict()) == c
    d = get_config("deepseek-v4-flash").to_hf_dict()
    assert d["rope_parameters"]["main"] == {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125
    }
    assert d["rope_parameters"]["compress"]["attention_factor"] == 1.0
    assert d["compress_rates"] == {CSA: 4, HCA: 128}


def test_default_schedule_is_transformers():
    assert default_layer_types(5) == (HCA, HCA, HCA, CSA, HCA)
    assert layer_types_from_ratios([0, 8, 64, 0, 9], 4, 8, 64) == (SLIDING, CSA, HCA, SLIDING)


@pytest.mark.parametrize("kw, match", [
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (dict(o_groups=3), "o_groups"),
    (dict(layer_types=(SLIDING,) * 42 + ("full",)), "layer_types"),
    (dict(layer_types=(SLIDING,)), "layer_types"),
    (dict(compress_rate_csa=1), "compress_rate_csa"),
    (dict(index_topk=0), "index_topk"),
])
def test_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(get_config("deepseek-v4-flash"), **kw)
    with pytest.raises(ValueError, match="compress_ratios"):
        layer_types_from_ratios([0, 5], 2)


def test_moe_schedule_and_fields():
    """transformers' MoE schedule: num_hash_layers (legacy) or mlp_layer_types; the tiny preset
    has one hash layer; intermediate_size is moe_intermediate_size (transformers' alias)."""
    flash = get_config("deepseek-v4-flash")
    assert flash.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 40 and flash.num_hash_layers == 3
    assert flash.intermediate_size == flash.moe_intermediate_size
    assert DeepseekV4Config.from_hf_dict(dict(FLASH_CONFIG_JSON, num_hash_layers=5)
                                         ).num_hash_layers == 5
    types = ["moe", "hash_moe"] + ["moe"] * 41
    c = DeepseekV4Config.from_hf_dict(dict(FLASH_CONFIG_JSON, mlp_layer_types=types))
    assert c.mlp_layer_types == tuple(types) and c.is_hash_layer(1) and not c.is_hash_layer(0)
    assert default_mlp_layer_types(2, 3) == ("hash_moe", "hash_moe")
    tiny = get_config("deepseek-v4-tiny")
    assert tiny.mlp_layer_types == ("hash_moe", "moe", "moe", "moe") and tiny.hc_mult == 2
    assert get_v4_config("deepseek-v4-tiny", num_hidden_layers=5).mlp_layer_types[-1] == "moe"
    assert tiny.to_hf_dict()["mlp_layer_types"] == list(tiny.mlp_layer_types)


@pytest.mark.parametrize("kw, match", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(mlp_layer_types=("moe",) * 42 + ("dense",)), "mlp_layer_types"),
    (dict(mlp_layer_types=("moe",)), "mlp_layer_types"),
    (dict(num_experts_per_tok=300), "num_experts_per_tok"),
    (dict(swiglu_limit=0.0), "swiglu_limit"),
    (dict(hc_mult=0), "hc_mult"),
])
def test_moe_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(get_config("deepseek-v4-flash"), **kw)
