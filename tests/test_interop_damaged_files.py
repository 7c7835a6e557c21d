"""load_hf refuses damaged or wrong files with the file named, and never allocates more than a file
holds (issue 49, items 7 and 8): truncated or empty safetensors files, header lengths past the end
(2^62 included), headers that are not JSON objects, entries whose byte range lies outside the
file, malformed ``config.json`` and index files, integer and bool tensors for float weights, and
DeepSeek V4 hash-routing tables (``tid2eid``) that are floats or hold ids outside the experts."""

from __future__ import annotations

import json
import re
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_dsa.configs import DSAConfig, RopeParameters
from jax_dsa.interop import load_hf, save_hf
from jax_dsa.nn import DSALanguageModel

TINY = dict(
    model_type="glm_moe_dsa", vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_topk=4,
    index_n_heads=4, index_head_dim=8, max_position_embeddings=64,
    rope_parameters=RopeParameters(rope_theta=10000.0), mlp_layer_types=("dense", "sparse"),
    moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
    tie_word_embeddings=False,
)


def _save(path, max_shard_size="5GB"):
    model = nnx.eval_shape(lambda: DSALanguageModel(DSAConfig(**TINY), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    flat = [(p, v.replace(rng.standard_normal(v.get_value().shape).astype(np.float32)))
            for p, v in nnx.to_flat_state(state)]
    save_hf(nnx.merge(graphdef, nnx.from_flat_state(flat)), path, max_shard_size=max_shard_size)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A single-file and a sharded checkpoint, copied per test."""
    root = tmp_path_factory.mktemp("saved")
    _save(root / "single")
    _save(root / "sharded", max_shard_size="20KB")
    return root


@pytest.fixture
def single(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "single", tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def sharded(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "sharded", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _refused(path, file, *phrases, error=ValueError):
    """load_hf(path) raises ``error`` naming ``file`` and saying each phrase."""
    with pytest.raises(error) as info:
        load_hf(path, dtype=jnp.float32)
    text = str(info.value)
    assert str(file) in text, text
    for phrase in phrases:
        assert re.search(phrase, text), (phrase, text)


def _header(file) -> tuple[dict, bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(file, header: dict | bytes, data: bytes):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _damage_file(file, case) -> tuple[str, ...]:
    """Damages the safetensors ``file`` as ``case`` says; returns what the error must say."""
    raw = file.read_bytes()
    header, data = _header(file)
    key = "model.norm.weight"  # 32 float32: 128 bytes
    entry = header[key]
    if case == "empty":
        file.write_bytes(b"")
        return ("too short",)
    if case == "short":
        file.write_bytes(b"\x10\x00")
        return ("too short",)
    if case == "truncated":
        file.write_bytes(raw[: len(raw) // 2])
        return ("truncated",)
    if case in ("length_past_end", "length_2_62"):
        n = len(raw) + 1 if case == "length_past_end" else 2**62
        file.write_bytes(struct.pack("<Q", n) + raw[8:])
        return (f"header length is {n} bytes",)
    if case in ("not_json", "not_utf8", "json_list"):
        text = {"not_json": b"{" + b"x" * 20, "not_utf8": b"\xff\xfe" * 10,
                "json_list": b"[1, 2]"}[case]
        _write(file, text, data)
        return ("JSON list, not an object",) if case == "json_list" else ("not UTF-8 JSON",)
    if case == "offsets_past_end":
        entry["data_offsets"] = [len(data) - 4, len(data) + 124]
        expect = (key, "truncated")
    elif case == "offsets_wrong_size":
        entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] - 4]
        expect = (key, "needs 128 bytes")
    elif case == "unknown_dtype":
        entry["dtype"] = "F128"
        expect = (key, "not a safetensors dtype")
    else:
        entry["shape"] = [-32]
        expect = (key, "not a list of sizes")
    _write(file, header, data)
    return expect


@pytest.mark.parametrize("case", ["empty", "short", "truncated", "length_past_end",
                                  "length_2_62", "not_json", "not_utf8", "json_list",
                                  "offsets_past_end", "offsets_wrong_size", "unknown_dtype",
                                  "bad_shape"])
def test_damaged_safetensors_file(single, case):
    file = single / "model.safetensors"
    # Sizes are checked against the file before anything is read: a header length of 2^62
    # gives this ValueError, not a MemoryError.
    _refused(single, file, "damaged safetensors file", *_damage_file(file, case))


@pytest.mark.parametrize("text,phrase", [("{", "not UTF-8 JSON"), ('["glm_moe_dsa"]', "JSON list"),
                                         ("", "not UTF-8 JSON")])
def test_damaged_config_json(single, text, phrase):
    (single / "config.json").write_text(text)
    _refused(single, single / "config.json", "damaged config.json", phrase)


@pytest.mark.parametrize("case", ["not_json", "list", "no_weight_map", "path_outside",
                                  "missing_file", "key_not_in_file"])
def test_damaged_index(sharded, case):
    index = sharded / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    key = "model.norm.weight"
    error = ValueError
    if case == "not_json":
        index.write_text('{"weight_map": ')
        expect = ("damaged checkpoint index", "not UTF-8 JSON")
    elif case == "list":
        index.write_text("[]")
        expect = ("damaged checkpoint index", "JSON list")
    elif case == "no_weight_map":
        index.write_text(json.dumps({"metadata": {}}))
        expect = ("'weight_map' object",)
    else:
        if case == "path_outside":
            content["weight_map"][key] = "../elsewhere.safetensors"
            expect = ("file names in the directory",)
        elif case == "missing_file":
            content["weight_map"][key] = "model-00099-of-00099.safetensors"
            expect, error = ("model-00099-of-00099",), FileNotFoundError
        else:  # the index says a shard holds a key its header lacks
            content["weight_map"]["model.extra.weight"] = content["weight_map"][key]
            expect = ("not in the files it names", "model.extra.weight")
        index.write_text(json.dumps(content))
    _refused(sharded, index, *expect, error=error)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_])
def test_integer_and_bool_weights_are_refused(single, dtype):
    file = single / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.0.self_attn.q_a_proj.weight"
    tensors[key] = np.ones(tensors[key].shape, dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    stored = {np.int8: "I8", np.uint8: "U8", np.int16: "I16", np.int32: "I32",
              np.int64: "I64", np.bool_: "BOOL"}[dtype]
    _refused(single, file, re.escape(key), stored, "refused as float weights")


# -------------------------------------------------------------------------------------------
# DeepSeek V4: the hash-routing table and unscaled integer weights


@pytest.fixture(scope="module")
def v4_saved(tmp_path_factory):
    """A 2-layer DeepSeek V4 model whose first layer routes by the hash table ``tid2eid``."""
    from jax_dsa.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
    from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel

    config = DeepseekV4Config.from_hf_dict({
        "vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16,
        "num_attention_heads": 2, "head_dim": 16, "q_lora_rank": 16, "partial_rotary_factor": 0.5,
        "o_groups": 2, "o_lora_rank": 8, "sliding_window": 8, "index_n_heads": 4,
        "index_head_dim": 16, "index_topk": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "compress_rates": {CSA: 4}, "num_nextn_predict_layers": 0, "num_hidden_layers": 2,
        "layer_types": [SLIDING, CSA], "mlp_layer_types": ["hash_moe", "moe"], "hc_mult": 2})
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4LanguageModel(
        config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)))
    rng = np.random.default_rng(0)
    flat = []
    for p, v in nnx.to_flat_state(state):
        x = v.get_value()
        if np.issubdtype(x.dtype, np.floating):
            a = rng.normal(0, 0.3, x.shape)
        else:  # tid2eid [vocab, top-k]: distinct experts per token
            a = np.stack([rng.permutation(4)[: x.shape[1]] for _ in range(x.shape[0])])
        flat.append((p, v.replace(a.astype(x.dtype))))
    path = tmp_path_factory.mktemp("v4") / "saved"
    save_hf(nnx.merge(graphdef, nnx.from_flat_state(flat)), path)
    load_hf(path, dtype=jnp.float32)  # as saved, it loads
    return path


@pytest.mark.parametrize("case", ["id_99", "id_minus_5", "float_table", "bool_table",
                                  "int16_weight"])
def test_v4_bad_hash_table_or_integer_weight_is_refused(v4_saved, tmp_path, case):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(v4_saved, ckpt)
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.0.ffn.gate.tid2eid"
    table = tensors[key].copy()
    assert table.dtype == np.int64 and table.shape == (64, 2)
    if case in ("id_99", "id_minus_5"):
        table[7, 1] = 99 if case == "id_99" else -5
        tensors[key] = table
        expect = (re.escape(key), r"expert ids in \[0, 4\)", "99" if case == "id_99" else "-5")
    elif case in ("float_table", "bool_table"):
        tensors[key] = table.astype(np.float32 if case == "float_table" else np.bool_)
        expect = (re.escape(key), "float32" if case == "float_table" else "bool",
                  "expects an int tensor")
    else:
        key = next(k for k in tensors if k.endswith("attn.wq_a.weight"))
        tensors[key] = np.ones(tensors[key].shape, np.int16)
        expect = (re.escape(key), "int16", "refused as float weights")
    save_file(tensors, file, metadata={"format": "pt"})
    _refused(ckpt, file, *expect)
