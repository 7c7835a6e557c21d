"""Tests for jax_dsa.models.deepseek_v4.checkpoint_layouts (and load_hf_attention on DeepSeek V4
checkpoints).

The reference is a real transformers 5.24 checkpoint: tests/hf_reference_v4/
v4_checkpoint_reference.py (run once, in ``.venv-hf`` or ``$JAX_DSA_HF_PYTHON``) builds a tiny
random ``DeepseekV4ForCausalLM`` (sliding / CSA / HCA layers, hash and top-k MoE, ``hc_mult`` 2),
``save_pretrained``s it in shards and dumps its ``state_dict``, per-layer attention outputs and
transformers' conversion of DeepSeek's release names. From that folder the tests make, with
NumPy + safetensors, a DeepSeek-release-named copy and quantised copies (UE8M0 block FP8 and
MXFP4 experts as in the release; transformers' ``weight_scale_inv`` FP8), and check that every
layout reads back to the ``state_dict`` (exactly; the quantised ones to an independent NumPy
dequantisation) and that ``load_hf_attention`` reproduces transformers' attention (max rel
error <= 1e-4, float32). Tests needing the reference skip when its interpreter is missing.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_dsa.interop import load_hf_attention
from jax_dsa.interop.hf_config import read_hf_config
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.models.deepseek_v4.attention import DeepseekV4Attention
from jax_dsa.models.deepseek_v4.checkpoint_layouts import (
    GATE_UP,
    Part,
    open_v4_checkpoint,
    save_pretrained_name,
    save_pretrained_parts,
    state_dict_name,
)
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config

ROOT = Path(__file__).resolve().parents[1]
HF_PYTHON = Path(os.environ.get("JAX_DSA_HF_PYTHON", ROOT / ".venv-hf" / "bin" / "python"))
SCRIPT = ROOT / "tests" / "hf_reference_v4" / "v4_checkpoint_reference.py"
TOL = 1e-4
# 16 index heads: fewer make exact-zero index-score ties that torch.topk breaks arbitrarily.
SPEC = {
    "seed": 3, "batch": 1, "seq_len": 64, "max_shard_size": "100KB",
    "hf_config": {
        "vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 32, "q_lora_rank": 32, "partial_rotary_factor": 0.25, "o_groups": 2,
        "o_lora_rank": 16, "index_n_heads": 16, "index_head_dim": 16,
        "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 3, "hc_mult": 2, "sliding_window": 16, "index_topk": 4,
        "layer_types": ["sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                            "original_max_position_embeddings": 1024},
    },
}
# What the release stores as block FP8 (DeepSeek-V4-Flash: attention, shared experts, indexer
# wq_b); the compressor / indexer wkv, wgate and weights_proj stay unquantised.
FP8_SUFFIXES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
                "attn.wo_b.weight", "attn.indexer.wq_b.weight", "shared_experts.w1.weight",
                "shared_experts.w2.weight", "shared_experts.w3.weight")
# Partial edge tiles on every FP8 weight of the tiny model (sides 32, 64, 128, 256).
FP8_BLOCK = (12, 24)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@nnx.jit
def _apply(attn, x, positions):
    return attn(x, positions, None, attention_mode="sparse", compute_indexer_loss=False)[0]


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _load_dir(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _write_dir(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not HF_PYTHON.exists():
        pytest.skip(f"no reference interpreter at {HF_PYTHON}: create .venv-hf (Python 3.11 with "
                    "torch and transformers 5.24) or set JAX_DSA_HF_PYTHON")
    work = tmp_path_factory.mktemp("hf_v4_ckpt")
    (work / "spec.json").write_text(json.dumps(SPEC))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(HF_PYTHON), str(SCRIPT), str(work / "spec.json"), str(work)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"reference failed:\n{proc.stderr[-4000:]}"
    names = json.loads((work / "release_names.json").read_text())
    return {
        "hf": work / "hf", "work": work,
        "state_dict": dict(np.load(work / "state_dict.npz")),
        "attention": dict(np.load(work / "attention.npz")),
        "release": {saved: release for saved, release, _ in names},
        # transformers' own conversion of the release names (model. is added by the loader).
        "converted": {release: (t if t.startswith("lm_head") else "model." + t)
                      for _, release, t in names},
    }


@pytest.fixture(scope="module")
def release_dir(reference):
    """The checkpoint under DeepSeek's release names, plus two MTP tensors (presented apart from
    the state_dict names; of no real shape, which only a whole-model load with MTP checks)."""
    tensors = {reference["release"][k]: v for k, v in _load_dir(reference["hf"]).items()}
    tensors["mtp.0.e_proj.weight"] = np.ones((64, 128), np.float32)
    tensors["mtp.0.attn.wq_a.weight"] = np.ones((32, 64), np.float32)
    return _write_dir(reference["work"] / "release", tensors, read_hf_config(reference["hf"]))


def _ue8m0(amax, vmax):
    """The power-of-two scale 2 ** ceil(log2(amax / vmax)) of DeepSeek's UE8M0 recipe."""
    return np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / vmax))).astype(np.float32)


def _quantize_fp8(w, block, pow2):
    """e4m3 codes and block scales [ceil(R / b0), ceil(C / b1)] (NumPy), and the dequantised
    oracle ``codes * scale`` broadcast over the tiles (in float64, then float32)."""
    b0, b1 = block
    (rows, cols), nr, nc = w.shape, -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    amax = np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            amax[i, j] = np.abs(w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]).max()
    scale = _ue8m0(amax, 448.0) if pow2 else (amax / 448.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, b0, 0), b1, 1)[:rows, :cols]
    codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
    oracle = (codes.astype(np.float64) * full.astype(np.float64)).astype(np.float32)
    return codes, scale, oracle


def _quantize_mxfp4(w):
    """MXFP4: E2M1 codes packed two per byte (even element low), UE8M0 scale per 32 inputs,
    and the oracle decoded with the E2M1 table."""
    scale = _ue8m0(np.abs(w.reshape(w.shape[0], -1, 32)).max(-1), 6.0)
    full = np.repeat(scale, 32, 1)
    codes = (w / full).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    table = np.array(E2M1, np.float32)
    return packed, scale, table[codes] * full


@pytest.fixture(scope="module")
def fp8_release_dir(reference, release_dir):
    """The release layout quantised as the release is: UE8M0 block FP8 and MXFP4 experts.
    Returns (path, oracle by state_dict name: the NumPy dequantisation of what was stored)."""
    tensors = load_file(release_dir / "model.safetensors")
    to_name = reference["converted"]
    oracle = {}
    for key in list(tensors):
        w = tensors[key]
        if key.endswith(FP8_SUFFIXES):
            codes, scale, oracle[key] = _quantize_fp8(w, FP8_BLOCK, pow2=True)
            tensors[key] = codes
            tensors[key.removesuffix(".weight") + ".scale"] = scale.astype(ml_dtypes.float8_e8m0fnu)
        elif ".ffn.experts." in key:
            tensors[key], scale, oracle[key] = _quantize_mxfp4(w)
            tensors[key.removesuffix(".weight") + ".scale"] = scale.astype(ml_dtypes.float8_e8m0fnu)
    config = dict(read_hf_config(release_dir), expert_dtype="fp4", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK)})
    path = _write_dir(reference["work"] / "release-fp8", tensors, config)
    by_name = {}
    for key, value in oracle.items():
        if key.startswith("mtp."):
            continue
        part = state_dict_name(key)
        assert part.name == to_name[key]
        by_name.setdefault(part.name, {})[(part.expert, part.half)] = value
    return path, by_name


def _oracle_value(parts):
    """A state_dict tensor from its on-disk parts ({(expert, half): array})."""
    if (None, None) in parts:
        return parts[(None, None)]
    experts = sorted({e for e, _ in parts})
    if any(h is not None for _, h in parts):
        return np.stack([np.concatenate([parts[(e, 0)], parts[(e, 1)]]) for e in experts])
    return np.stack([parts[(e, None)] for e in experts])


# ------------------------------------------------------------------------------------------------
# Names


def test_save_pretrained_folder_reads_as_state_dict(reference):
    """Every tensor of transformers' save_pretrained output reads back as model.state_dict()."""
    sd = reference["state_dict"]
    with open_v4_checkpoint(reference["hf"]) as ckpt:
        assert ckpt.layout == "save_pretrained"
        assert ckpt.ignored == [] and ckpt.unknown == []
        assert sorted(ckpt.keys()) == sorted(sd)
        for name, want in sd.items():
            assert ckpt.shape(name) == want.shape, name
            got = ckpt.read(name)
            assert got.dtype == want.dtype == ckpt.dtype(name), name
            np.testing.assert_array_equal(got, want, err_msg=name)
        # A device's slice of the fused experts reads only what it covers, and equals the slice.
        name = f"model.layers.1.{GATE_UP}"
        for index in [(slice(1, 3), slice(20, 45), slice(3, 64)),
                      (slice(0, 4, 2), slice(0, 32), slice(None))]:
            np.testing.assert_array_equal(ckpt.read(name, index), sd[name][index])


def test_state_dict_layout(reference, tmp_path):
    """The in-memory names stored as they are (``save_file(model.state_dict())``) read too."""
    sd = reference["state_dict"]
    _write_dir(tmp_path, sd, read_hf_config(reference["hf"]))
    with open_v4_checkpoint(tmp_path) as ckpt:
        assert ckpt.layout == "state_dict" and sorted(ckpt.keys()) == sorted(sd)
        for name, want in sd.items():
            np.testing.assert_array_equal(ckpt.read(name), want, err_msg=name)


def test_release_names_are_transformers_conversion(reference):
    """DeepSeek's release names map to the names transformers' deepseek_v4 conversion gives."""
    for release, want in reference["converted"].items():
        part = state_dict_name(release)
        assert part is not None and part.name == want, (release, part, want)


def test_mtp_names():
    """The release's MTP keys <-> jax_dsa's model.mtp.K names (DeepSeek V4 MTPBlock: a layer's
    tensors plus e_proj, h_proj, enorm, hnorm, norm and its own hyper head)."""
    pairs = {
        "mtp.0.e_proj.weight": "model.mtp.0.e_proj.weight",
        "mtp.0.norm.weight": "model.mtp.0.norm.weight",
        "mtp.1.hc_head_scale": "model.mtp.1.hc_head.hc_scale",
        "mtp.0.attn.kv_norm.weight": "model.mtp.0.self_attn.kv_norm.weight",
        "mtp.0.attn_norm.weight": "model.mtp.0.input_layernorm.weight",
        "mtp.0.hc_ffn_fn": "model.mtp.0.ffn_hc.fn",
        "mtp.0.ffn.gate.bias": "model.mtp.0.mlp.gate.e_score_correction_bias",
        "mtp.0.ffn.shared_experts.w2.weight": "model.mtp.0.mlp.shared_experts.down_proj.weight",
    }
    for key, name in pairs.items():
        assert state_dict_name(key).name == name, key
        assert state_dict_name(name).name == name, name  # the state_dict layout
        for layout in ("save_pretrained", "deepseek"):
            assert save_pretrained_name(name, layout) == key
        assert save_pretrained_name(name, "state_dict") == name
    assert state_dict_name("mtp.0.ffn.experts.5.w3.weight") == Part(
        f"model.mtp.0.{GATE_UP}", 5, 1)
    assert save_pretrained_parts(f"model.mtp.0.{GATE_UP}", (2, 8, 4))[3] == (
        "mtp.0.ffn.experts.1.w3.weight", (1, slice(4, 8)))
    assert state_dict_name("mtp.0.bogus.weight") is None


def test_save_pretrained_parts_reproduce_the_folder(reference):
    """state_dict -> save_pretrained_parts writes exactly the keys and values transformers
    writes."""
    sd = reference["state_dict"]
    disk = _load_dir(reference["hf"])
    ours = {}
    for name, value in sd.items():
        for key, index in save_pretrained_parts(name, value.shape):
            assert key not in ours, key
            ours[key] = value[index]
    assert sorted(ours) == sorted(disk)
    for key, value in disk.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    assert save_pretrained_name("model.layers.0.self_attn.kv_norm.weight") == \
        "model.layers.0.attn.norm.weight"
    assert save_pretrained_name("model.hc_head.hc_fn", "deepseek") == "hc_head_fn"
    with pytest.raises(ValueError, match="save_pretrained_parts"):
        save_pretrained_name(f"model.layers.0.{GATE_UP}")
    with pytest.raises(ValueError, match="no DeepSeek V4 state_dict name"):
        save_pretrained_parts("model.layers.0.self_attn.bogus", (1,))


def test_release_layout_reads_as_state_dict(reference, release_dir):
    sd = reference["state_dict"]
    with open_v4_checkpoint(release_dir) as ckpt:
        assert ckpt.layout == "deepseek"
        assert ckpt.ignored == [] and ckpt.mtp_depths == [0]
        assert sorted(ckpt.mtp_keys()) == ["model.mtp.0.e_proj.weight",
                                           "model.mtp.0.self_attn.q_a_proj.weight"]
        np.testing.assert_array_equal(ckpt.read("model.mtp.0.e_proj.weight"), np.ones((64, 128)))
        np.testing.assert_array_equal(ckpt.read_disk("mtp.0.e_proj.weight"), np.ones((64, 128)))
        assert sorted(ckpt.keys()) == sorted(sd)
        for name, want in sd.items():
            np.testing.assert_array_equal(ckpt.read(name), want, err_msg=name)


# ------------------------------------------------------------------------------------------------
# load_hf_attention


def _attention(path, layer):
    config = DeepseekV4Config.from_hf_dict(read_hf_config(path))
    attn = DeepseekV4Attention(config, layer, rngs=nnx.Rngs(0))
    nnx.update(attn, load_hf_attention(path, layer))
    return attn


def test_load_hf_attention_from_save_pretrained_matches_transformers(reference):
    """The CSA layer (compressor and indexer included; 64 tokens > window 16, 16 compressed
    entries > top-k 4) loaded from a save_pretrained folder gives transformers' output. The
    other layer types load to the state_dict exactly (next test); their math is checked against
    transformers in tests/test_models_deepseek_v4_attention.py."""
    ref = reference["attention"]
    x, positions = jnp.asarray(ref["hidden_states"]), jnp.asarray(ref["position_ids"])
    attn = _attention(reference["hf"], 1)
    assert attn.layer_type == "compressed_sparse_attention"
    err = _rel(_apply(attn, x, positions), ref["out.1"])
    print(f"CSA layer: max-rel error {err:.2e}")
    assert err <= TOL, err


def test_load_hf_attention_release_and_fp8_layouts(reference, release_dir, fp8_release_dir):
    """The release layout loads to the same weights; its FP8 / MXFP4 copy to the NumPy
    dequantisation of what was stored (exactly)."""
    fp8_dir, oracle = fp8_release_dir
    for layer in range(3):
        saved = dict(nnx.to_flat_state(load_hf_attention(reference["hf"], layer)))
        release = dict(nnx.to_flat_state(load_hf_attention(release_dir, layer)))
        quant = dict(nnx.to_flat_state(load_hf_attention(fp8_dir, layer)))
        assert saved.keys() == release.keys() == quant.keys()
        n_quant = 0
        for path, var in saved.items():
            name = f"model.layers.{layer}.self_attn." + ".".join(str(p) for p in path)
            want = reference["state_dict"][name]
            np.testing.assert_array_equal(np.asarray(var.get_value()), want, err_msg=name)
            np.testing.assert_array_equal(np.asarray(release[path].get_value()), want)
            got = np.asarray(quant[path].get_value())
            if name in oracle:
                n_quant += 1
                np.testing.assert_array_equal(got, _oracle_value(oracle[name]), err_msg=name)
                assert not np.array_equal(got, want)  # it really was quantised
            else:
                np.testing.assert_array_equal(got, want, err_msg=name)
        assert n_quant == (6 if layer == 1 else 5)


def test_fp8_release_layout_whole_model(reference, fp8_release_dir):
    """Every tensor of the quantised release, experts included, against the NumPy oracle; and
    device-sized slices dequantise like the whole."""
    path, oracle = fp8_release_dir
    sd = reference["state_dict"]
    with open_v4_checkpoint(path) as ckpt:
        assert ckpt.layout == "deepseek"
        n_fp8 = sum(len(parts) for name, parts in oracle.items() if ".experts." not in name)
        assert ckpt.quantized == {"fp8": n_fp8 + 1, "mxfp4": 3 * 3 * 4}  # + mtp.0.attn.wq_a
        # Ones, stored as e4m3 256 times a UE8M0 scale 2**-8.
        with CheckpointReader(path) as raw:
            assert raw.dtype("mtp.0.attn.wq_a.weight") == "F8_E4M3"
        np.testing.assert_array_equal(ckpt.read_disk("mtp.0.attn.wq_a.weight"), np.ones((32, 64)))
        np.testing.assert_array_equal(ckpt.read("model.mtp.0.self_attn.q_a_proj.weight",
                                                (slice(3, 20), slice(0, 64, 2))),
                                      np.ones((17, 32)))
        assert sorted(ckpt.keys()) == sorted(sd)
        for name in sd:
            want = _oracle_value(oracle[name]) if name in oracle else sd[name]
            got = ckpt.read(name)
            assert got.dtype == ckpt.dtype(name)
            np.testing.assert_array_equal(got, want, err_msg=name)
        name = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"  # FP8 [256, 32]
        gate_up, down = f"model.layers.2.{GATE_UP}", "model.layers.2.mlp.experts.down_proj"
        for n, index in [(name, (slice(5, 40), slice(7, 31))),
                         (name, (slice(250, 256), slice(0, 1))),
                         (gate_up, (slice(1, 2), slice(30, 34), slice(31, 35))),
                         (down, (slice(0, 4), slice(63, 64), slice(1, 32)))]:
            np.testing.assert_array_equal(ckpt.read(n, index), ckpt.read(n)[index])


def test_transformers_fp8_weight_scale_inv(reference):
    """transformers' own FP8 format (``weight_scale_inv``, float scales) on save_pretrained
    names dequantises like reading.CheckpointSource does."""
    tensors = _load_dir(reference["hf"])
    oracle = {}
    for key in [k for k in tensors if k.endswith(FP8_SUFFIXES) and ".layers.1." in k]:
        tensors[key], scale, oracle[key] = _quantize_fp8(tensors[key], (16, 16), pow2=False)
        tensors[key + "_scale_inv"] = scale
    config = dict(read_hf_config(reference["hf"]), quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]})
    path = _write_dir(reference["work"] / "hf-fp8", tensors, config)
    with open_v4_checkpoint(path) as ckpt:
        assert ckpt.layout == "save_pretrained" and ckpt.quantized["fp8"] == len(oracle) == 9
        for key, want in oracle.items():
            name = state_dict_name(key).name
            assert f"{key}_scale_inv" in ckpt.disk_keys(name)
            np.testing.assert_array_equal(ckpt.read(name), want, err_msg=key)


# ------------------------------------------------------------------------------------------------
# Formats without the reference: F4 storage and refusals


_CONFIG = {"model_type": "deepseek_v4", "n_routed_experts": 1}


def _write_raw(path: Path, entries: dict, config: dict) -> Path:
    """A safetensors file from (dtype, shape, bytes) entries (dtypes NumPy cannot hold: F4)."""
    path.mkdir(parents=True, exist_ok=True)
    header, blobs, offset = {}, [], 0
    for key, (dtype, shape, data) in entries.items():
        header[key] = {"dtype": dtype, "shape": list(shape),
                       "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_mxfp4_as_f4_equals_packed_int8(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    packed, scale, oracle = _quantize_mxfp4(w)
    s8 = scale.astype(ml_dtypes.float8_e8m0fnu)
    key = "layers.0.ffn.experts.0.w2.weight"
    as_f4 = _write_raw(tmp_path / "f4", {
        key: ("F4", (8, 64), packed.tobytes()),
        "layers.0.ffn.experts.0.w2.scale": ("F8_E8M0", s8.shape, s8.tobytes()),
    }, _CONFIG)
    as_u8 = _write_dir(tmp_path / "u8", {  # the UE8M0 exponent bytes, untyped
        key: packed.view(np.uint8), "layers.0.ffn.experts.0.w2.scale": s8.view(np.uint8),
    }, _CONFIG)
    name = "model.layers.0.mlp.experts.down_proj"
    for path in (as_f4, as_u8):
        with open_v4_checkpoint(path) as ckpt:
            assert ckpt.shape(name) == (1, 8, 64) and ckpt.quantized["mxfp4"] == 1
            np.testing.assert_array_equal(ckpt.read(name)[0], oracle)
            np.testing.assert_array_equal(ckpt.read(name, (slice(0, 1), slice(2, 5),
                                                           slice(33, 63)))[0], oracle[2:5, 33:63])


@pytest.mark.parametrize("case", [
    "quant_method", "fp8_no_scale", "mxfp4_bad_scale", "int8_no_scale", "f32_with_scale",
    "f4_no_scale", "bad_scale_dtype", "mixed_layouts", "experts_missing", "twice",
])
def test_refusals_name_the_tensor(tmp_path, case):
    w = np.ones((32, 64), np.float32)
    key = "layers.0.attn.wq_a.weight"
    tensors, config, match = {}, dict(_CONFIG), key
    if case == "quant_method":
        config["quantization_config"], match = {"quant_method": "gptq"}, "quant_method 'gptq'"
        tensors[key] = w
    elif case == "fp8_no_scale":
        tensors[key] = w.astype(ml_dtypes.float8_e4m3fn)
    elif case == "mxfp4_bad_scale":
        key = "layers.0.ffn.experts.0.w1.weight"
        tensors[key] = np.zeros((32, 32), np.int8)
        tensors["layers.0.ffn.experts.0.w1.scale"] = np.ones((32, 1), ml_dtypes.float8_e8m0fnu)
        match = r"MXFP4 scale layers.0.ffn.experts.0.w1.scale has shape \(32, 1\)"
    elif case == "int8_no_scale":
        tensors[key] = np.zeros((32, 32), np.int8)
    elif case == "f32_with_scale":
        tensors[key], tensors["layers.0.attn.wq_a.scale"] = w, np.ones((1, 1), np.float32)
    elif case == "f4_no_scale":
        _write_raw(tmp_path, {key: ("F4", (32, 64), bytes(32 * 32))}, config)
        match = "dtype F4 without a scale"
    elif case == "bad_scale_dtype":
        tensors[key] = w.astype(ml_dtypes.float8_e4m3fn)
        tensors["layers.0.attn.wq_a.scale"] = np.ones((1, 1), np.int32)
        match = "scale layers.0.attn.wq_a.scale is I32"
    elif case == "mixed_layouts":
        tensors[key], tensors["model.layers.1.attn.wq_a.weight"] = w, w
        match = "mixes model.layers"
    elif case == "experts_missing":
        config["n_routed_experts"] = 2
        tensors["layers.0.ffn.experts.0.w2.weight"] = w
        match = "mlp.experts.down_proj has experts"
    elif case == "twice":
        tensors[key], tensors["layers.0.self_attn.q_a_proj.weight"] = w, w
        match = "stored twice"
    if tensors:
        _write_dir(tmp_path, tensors, config)
    with pytest.raises(ValueError, match=match):
        open_v4_checkpoint(tmp_path)


def test_load_hf_attention_rejects_unknown_layer_tensors(reference, tmp_path):
    tensors = _load_dir(reference["hf"])
    tensors["model.layers.0.attn.bogus.weight"] = np.ones((2, 2), np.float32)
    path = _write_dir(tmp_path, tensors, read_hf_config(reference["hf"]))
    with pytest.raises(ValueError, match=r"unknown attention tensors \['model.layers.0.attn.bogus"):
        load_hf_attention(path, 0)
