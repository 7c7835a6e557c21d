"""Whole DeepSeek V4 models against transformers' ``DeepseekV4ForCausalLM``
(jax_dsa.models.deepseek_v4.checkpoint, jax_dsa.models.deepseek_v4.model): logits of tiny random
models loaded from a transformers ``save_pretrained`` folder, and ``save_hf`` output loaded back by
transformers.

The reference runs in the Hugging Face interpreter (``.venv-hf`` or ``$JAX_DSA_HF_PYTHON``)
through tests/hf_reference_v4/v4_model_reference.py: it draws every parameter and buffer at
random (routers' correction biases and hash tables included), saves with ``save_pretrained`` and
records float32 logits (eager attention). The tests skip when that interpreter is missing.

The models mix every attention type, top-k and hash MoE layers, 1 to 3 hyper-connection streams,
both scoring functions, an active SwiGLU clip, tied embeddings and YaRN; every row is longer
than the window (8) and has more compressed entries than the indexer's top-k (4). 16 indexer heads
keep the indexer's scores free of exact ties (with few heads several entries score exactly 0
and torch.topk breaks the tie arbitrarily). Error: ``max |jax - ref| / max |ref|`` <= 1e-4.

The multi-token-prediction tests need no reference (transformers has no MTP): a tiny model with
2 MTP depths round-trips through save_hf / load_hf bitwise, and a DeepSeek-release-named folder
with its MTP projections in block FP8 (made with NumPy) loads to the NumPy dequantisation.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jax_dsa.interop import config_to_hf, load_hf, load_hf_config, save_hf
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.models.deepseek_v4.checkpoint import save_v4, state_dict_name
from jax_dsa.models.deepseek_v4.checkpoint_layouts import open_v4_checkpoint
from jax_dsa.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel

ROOT = Path(__file__).resolve().parents[1]
HF_PYTHON = Path(os.environ.get("JAX_DSA_HF_PYTHON", ROOT / ".venv-hf" / "bin" / "python"))
SCRIPT = ROOT / "tests" / "hf_reference_v4" / "v4_model_reference.py"
TOL = 1e-4

_BASE = {
    "vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16, "num_attention_heads": 2,
    "head_dim": 16, "q_lora_rank": 16, "partial_rotary_factor": 0.5, "o_groups": 2,
    "o_lora_rank": 8, "sliding_window": 8, "index_n_heads": 16, "index_head_dim": 16,
    "index_topk": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "compress_rates": {CSA: 4, HCA: 8}, "num_nextn_predict_layers": 0,
}
SPECS = [
    {"name": "mix4", "seed": 0, "batch": 2, "seq_len": 40, "hf_config": dict(
        _BASE, num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"], hc_mult=2)},
    {"name": "clip-tied-yarn", "seed": 1, "batch": 1, "seq_len": 44, "hf_config": dict(
        _BASE, num_hidden_layers=2, layer_types=[HCA, CSA], mlp_layer_types=["moe", "hash_moe"],
        hc_mult=3, hc_sinkhorn_iters=5, scoring_func="sigmoid", routed_scaling_factor=2.5,
        swiglu_limit=0.3, tie_word_embeddings=True, num_experts_per_tok=3,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32,
                         "beta_slow": 1})},
]
NAMES = [s["name"] for s in SPECS]


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _run(job: dict, work: Path, tag: str):
    if not HF_PYTHON.exists():
        pytest.skip(f"no reference interpreter at {HF_PYTHON}: create .venv-hf (Python 3.11 with "
                    "torch and transformers 5.24) or set JAX_DSA_HF_PYTHON")
    (work / f"{tag}.json").write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(HF_PYTHON), str(SCRIPT), str(work / f"{tag}.json"), str(work)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"reference failed:\n{proc.stderr[-4000:]}"


_forward = nnx.jit(lambda model, ids: model(ids, compute_indexer_loss=False)[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each spec: its save_pretrained folder, input ids and reference logits; then our logits
    from that folder, our save_hf of the loaded model, and transformers' logits from it (two
    reference processes in all)."""
    work = tmp_path_factory.mktemp("hf_v4_lm")
    _run({"build": SPECS}, work, "build")
    out = {}
    for spec in SPECS:
        name = spec["name"]
        r = dict(np.load(work / f"{name}.npz"))
        model = load_hf(work / name, dtype=jnp.float32)
        saved = work / f"{name}-jax"
        save_hf(model, saved, max_shard_size="40KB" if name == "mix4" else "5GB")
        out[name] = dict(folder=work / name, saved=saved, ids=r["input_ids"],
                         ref=r["logits"], model=model,
                         logits=np.asarray(_forward(model, jnp.asarray(r["input_ids"]))))
    _run({"load": [{"name": f"{n}-back", "path": str(out[n]["saved"]),
                    "input_ids": out[n]["ids"].tolist()} for n in NAMES]}, work, "load")
    for n in NAMES:
        out[n]["back"] = dict(np.load(work / f"{n}-back.npz"))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_from_save_pretrained_equal_transformers(reference, name):
    r = reference[name]
    assert r["logits"].shape == r["ref"].shape
    err = _rel(r["logits"], r["ref"])
    print(f"{name}: max rel {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_save_hf_loads_in_transformers_with_identical_logits(reference, name):
    r = reference[name]
    back = r["back"]
    assert json.loads(str(back["missing_json"])) == []
    assert json.loads(str(back["unexpected_json"])) == []
    assert json.loads(str(back["mismatched_json"])) == []
    # the same float32 weights in the same torch model: the same logits, to the last bit
    assert _rel(back["logits"], r["ref"]) <= 1e-6


def test_save_hf_writes_the_save_pretrained_layout(reference):
    """Key for key, shape for shape and dtype for dtype what transformers writes (sharded here),
    and a config transformers' model of which is ours."""
    r = reference["mix4"]
    with CheckpointReader(r["folder"]) as theirs, CheckpointReader(r["saved"]) as ours:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for k in theirs.keys():
            assert (ours.shape(k), ours.dtype(k)) == (theirs.shape(k), theirs.dtype(k)), k
    assert (r["saved"] / "model.safetensors.index.json").exists()
    assert load_hf_config(r["saved"]) == load_hf_config(r["folder"])
    reloaded = load_hf(r["saved"], dtype=jnp.float32)
    a, b = nnx.to_flat_state(nnx.state(reloaded)), nnx.to_flat_state(nnx.state(r["model"]))
    for (pa, va), (pb, vb) in zip(a, b, strict=True):
        assert pa == pb and np.array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))


def test_config_from_transformers(reference):
    r = reference["clip-tied-yarn"]
    hf = json.loads((r["folder"] / "config.json").read_text())
    c = load_hf_config(r["folder"])
    assert isinstance(c, DeepseekV4Config)
    assert c.mlp_layer_types == tuple(hf["mlp_layer_types"]) and c.num_hash_layers == 1
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.scoring_func) == (3, 5, "sigmoid")
    assert c.swiglu_limit == 0.3 and c.tie_word_embeddings
    assert c.qk_rope_head_dim == 8 and c.compress_rate_hca == 8
    rp = c.compress_rope_parameters
    assert (rp.rope_type, rp.factor, rp.cos_sin_scale) == ("yarn", 4.0, 1.0)
    assert DeepseekV4Config.from_hf_dict(config_to_hf(c)) == c


def test_state_dict_names():
    assert state_dict_name(("layers", 3, "mlp", "experts", "up_proj")) == (
        "model.layers.3.mlp.experts.gate_up_proj", 1)
    assert state_dict_name(("layers", 0, "mlp", "experts", "gate_proj")) == (
        "model.layers.0.mlp.experts.gate_up_proj", 0)
    assert state_dict_name(("layers", 0, "mlp", "experts", "down_proj")) == (
        "model.layers.0.mlp.experts.down_proj", None)
    assert state_dict_name(("hc_head", "hc_fn")) == ("model.hc_head.hc_fn", None)
    assert state_dict_name(("lm_head", "weight")) == ("lm_head.weight", None)
    assert state_dict_name(("mtp", 1, "mlp", "experts", "up_proj")) == (
        "model.mtp.1.mlp.experts.gate_up_proj", 1)
    assert state_dict_name(("mtp", 0, "hc_head", "hc_fn")) == ("model.mtp.0.hc_head.hc_fn", None)


def test_load_errors(reference, tmp_path):
    r = reference["clip-tied-yarn"]
    with pytest.raises(TypeError, match="DeepseekV4LanguageModel"):
        save_hf(object(), tmp_path / "x")
    # a checkpoint of a bigger model: the tensors of its extra layer belong to no parameter
    hf = json.loads((r["folder"] / "config.json").read_text())
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(dict(
        hf, num_hidden_layers=1, layer_types=hf["layer_types"][:1],
        mlp_layer_types=hf["mlp_layer_types"][:1])))
    (small / "model.safetensors").symlink_to(r["folder"] / "model.safetensors")
    with pytest.raises(ValueError, match="belong to no parameter"):
        load_hf(small, dtype=jnp.float32)
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(dict(
        hf, num_hidden_layers=3, layer_types=hf["layer_types"] + [SLIDING],
        mlp_layer_types=hf["mlp_layer_types"] + ["moe"])))
    (big / "model.safetensors").symlink_to(r["folder"] / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        load_hf(big, dtype=jnp.float32)


def test_bfloat16_load_keeps_float32_where_transformers_does(reference):
    model = load_hf(reference["mix4"]["folder"], dtype=jnp.bfloat16)
    assert isinstance(model, DeepseekV4LanguageModel)
    layer = model.layers[1]
    assert layer.self_attn.q_a_proj.weight[...].dtype == jnp.bfloat16
    assert model.layers[1].mlp.experts.gate_proj[...].dtype == jnp.bfloat16
    for p in (layer.attn_hc.fn, layer.input_layernorm.weight, layer.mlp.gate.weight,
              model.hc_head.hc_fn, model.norm.weight, layer.self_attn.sinks):
        assert p[...].dtype == jnp.float32
    assert model.layers[0].mlp.gate.tid2eid[...].dtype == jnp.int32


def test_load_onto_a_mesh_streams_each_device_slice(reference):
    """dp=2, tp=2: every parameter placed by its logical axes (experts' gate / up rows split over
    tp, each from its half of the fused gate_up_proj) and equal to the one-device load."""
    r = reference["mix4"]
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), devices=jax.devices()[:4])
    sharded = load_hf(r["folder"], dtype=jnp.float32, mesh=mesh)
    experts = sharded.layers[1].mlp.experts
    assert experts.up_proj[...].sharding.spec == P(None, "tp", None)
    assert experts.down_proj[...].sharding.spec == P(None, None, "tp")
    a, b = nnx.to_flat_state(nnx.state(sharded)), nnx.to_flat_state(nnx.state(r["model"]))
    for (pa, va), (pb, vb) in zip(a, b, strict=True):
        assert pa == pb and np.array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))


def test_deepseek_release_naming_loads_the_same_model(reference, tmp_path):
    """The loaded model written under DeepSeek's release names (``layers.N.attn.wq_a``,
    ``embed.weight``, ``ffn.experts.E.w1``, ...) loads back equal, and gives the same logits."""
    r = reference["clip-tied-yarn"]
    save_v4(r["model"], tmp_path, layout="deepseek")
    with CheckpointReader(tmp_path) as reader:
        assert "embed.weight" in reader and "layers.1.attn.wq_a.weight" in reader
    back = load_hf(tmp_path, dtype=jnp.float32)
    a, b = nnx.to_flat_state(nnx.state(back)), nnx.to_flat_state(nnx.state(r["model"]))
    for (pa, va), (pb, vb) in zip(a, b, strict=True):
        assert pa == pb and np.array_equal(np.asarray(va.get_value()), np.asarray(vb.get_value()))
    assert _rel(_forward(back, jnp.asarray(r["ids"])), r["ref"]) <= TOL


# ------------------------------------------------------------------------------------------------
# Multi-token prediction (no transformers reference: transformers 5.24 has no MTP module)

MTP_HF = dict(_BASE, num_hidden_layers=2, layer_types=[SLIDING, CSA],
              mlp_layer_types=["hash_moe", "moe"], hc_mult=2, num_nextn_predict_layers=2)
# The release's block-FP8 weights of an MTP depth (DeepSeek-V4-Flash; the experts are MXFP4 there,
# tested for the main layers in tests/test_models_deepseek_v4_checkpoint_layouts.py), keyed by the
# jax_dsa path.
MTP_FP8 = {
    "e_proj.weight": ("e_proj", "weight"), "h_proj.weight": ("h_proj", "weight"),
    "attn.wq_a.weight": ("self_attn", "q_a_proj", "weight"),
    "attn.wq_b.weight": ("self_attn", "q_b_proj", "weight"),
    "attn.wkv.weight": ("self_attn", "kv_proj", "weight"),
    "attn.wo_a.weight": ("self_attn", "o_a_proj", "weight"),
    "attn.wo_b.weight": ("self_attn", "o_b_proj", "weight"),
    "ffn.shared_experts.w1.weight": ("mlp", "shared_experts", "gate_proj", "weight"),
    "ffn.shared_experts.w2.weight": ("mlp", "shared_experts", "down_proj", "weight"),
    "ffn.shared_experts.w3.weight": ("mlp", "shared_experts", "up_proj", "weight"),
}
_forward_mtp = nnx.jit(lambda model, ids: model(ids, compute_indexer_loss=False))


def _flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny V4 model with 2 MTP depths, every float parameter and buffer random (norms,
    correction biases, hyper heads included; hash tables a random expert choice per token),
    saved by save_hf; and its logits on one row. Built abstractly and filled with NumPy draws
    placed on the first device as the loader places them (so one compiled forward serves the
    loaded models too)."""
    config = DeepseekV4Config.from_hf_dict(MTP_HF)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4LanguageModel(
        config, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32, mtp=True)))
    rng = np.random.default_rng(5)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = []
    for p, v in nnx.to_flat_state(state):
        x = v.get_value()
        if jnp.issubdtype(x.dtype, jnp.floating):
            a = rng.normal(0, 0.3, x.shape)
        else:  # tid2eid [vocab, top-k]: distinct experts per token
            a = np.stack([rng.permutation(config.n_routed_experts)[:x.shape[1]]
                          for _ in range(x.shape[0])])
        flat.append((p, v.replace(jax.device_put(a.astype(x.dtype), device))))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    path = tmp_path_factory.mktemp("v4_mtp") / "saved"
    save_hf(model, path)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (1, 20)), jnp.int32)
    return dict(model=model, path=path, ids=ids, out=_forward_mtp(model, ids))


def test_mtp_save_load_round_trip(mtp_model, tmp_path):
    """save_hf writes the MTP depths under DeepSeek's release keys next to transformers' layout;
    load_hf builds them back (mtp=None: the config says 2 depths and the tensors are there):
    parameters bitwise equal, main and MTP logits equal. mtp=False skips them."""
    path, model = mtp_model["path"], mtp_model["model"]
    with CheckpointReader(path) as reader:
        keys = set(reader.keys())
    for k in ("mtp.0.e_proj.weight", "mtp.1.hc_head_fn", "mtp.0.attn.kv_norm.weight",
              "mtp.1.ffn.experts.3.w3.weight", "mtp.0.ffn.gate.bias",
              "model.layers.0.attn.wq_a.weight"):
        assert k in keys, k
    assert not any(k.startswith("model.mtp.") for k in keys)
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 2
    back = load_hf(path, dtype=jnp.float32)
    assert back.mtp is not None and len(back.mtp) == 2
    want, got = _flat(model), _flat(back)
    assert sorted(got) == sorted(want)
    for p, value in want.items():
        assert got[p].dtype == value.dtype and np.array_equal(got[p], value), p
    logits, aux = _forward_mtp(back, mtp_model["ids"])
    ref_logits, ref_aux = mtp_model["out"]
    np.testing.assert_array_equal(logits, ref_logits)
    assert len(aux["mtp_logits"]) == 2
    for a, b in zip(aux["mtp_logits"], ref_aux["mtp_logits"], strict=True):
        np.testing.assert_array_equal(a, b)
    plain = load_hf(path, dtype=jnp.float32, mtp=False)
    assert plain.mtp is None
    # The release layout and the in-memory names round-trip too.
    for layout in ("deepseek", "state_dict"):
        save_v4(model, tmp_path / layout, layout=layout)
        again = _flat(load_hf(tmp_path / layout, dtype=jnp.float32, mtp=True))
        assert all(np.array_equal(again[p], v) for p, v in want.items()), layout


def test_mtp_load_errors(mtp_model, tmp_path):
    path = mtp_model["path"]
    hf = json.loads((path / "config.json").read_text())
    one = tmp_path / "one"  # the config asks for 1 depth, the checkpoint holds 2
    one.mkdir()
    (one / "config.json").write_text(json.dumps(dict(hf, num_nextn_predict_layers=1)))
    (one / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=r"belong to no parameter.*model\.mtp\.1\."):
        load_hf(one, dtype=jnp.float32)
    assert len(load_hf(one, dtype=jnp.float32, mtp=False).layers) == 2
    three = tmp_path / "three"
    three.mkdir()
    (three / "config.json").write_text(json.dumps(dict(hf, num_nextn_predict_layers=3)))
    (three / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks .*model\.mtp\.2\..*mtp=False"):
        load_hf(three, dtype=jnp.float32)
    none = tmp_path / "none"  # no MTP tensors (what transformers' save_pretrained writes)
    none.mkdir()
    save_file({k: v for k, v in load_file(path / "model.safetensors").items()
               if not k.startswith("mtp.")}, str(none / "model.safetensors"))
    (none / "config.json").write_text(json.dumps(hf))
    assert load_hf(none, dtype=jnp.float32).mtp is None  # 2 depths configured, none stored
    with pytest.raises(ValueError, match="holds no MTP tensors"):
        load_hf(none, dtype=jnp.float32, mtp=True)
    (none / "config.json").write_text(json.dumps(dict(hf, num_nextn_predict_layers=0)))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        load_hf(none, dtype=jnp.float32, mtp=True)
    # A key under mtp.K. that is no MTP tensor: listed in ckpt.ignored, refused when MTP is built.
    odd = tmp_path / "odd"
    odd.mkdir()
    save_file(dict(load_file(path / "model.safetensors"), **{"mtp.0.bogus.weight": np.ones(2)}),
              str(odd / "model.safetensors"))
    (odd / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"belong to no parameter.*mtp\.0\.bogus\.weight"):
        load_hf(odd, dtype=jnp.float32)
    assert load_hf(odd, dtype=jnp.float32, mtp=False).mtp is None


def test_release_fp8_mtp_weights_load_to_numpy_dequantisation(mtp_model, tmp_path):
    """The release layout with its MTP projections in block FP8 (e4m3 codes, UE8M0 ``.scale``
    per 12 x 24 tile: partial edge tiles on every weight), made here with NumPy: each loads to
    ``codes * scale`` of its tile, every other tensor unchanged."""
    model, block = mtp_model["model"], (12, 24)
    src = tmp_path / "release"
    save_v4(model, src, layout="deepseek")
    tensors = load_file(src / "model.safetensors")
    oracle = {}
    for k in range(2):
        for suffix, path in MTP_FP8.items():
            key = f"mtp.{k}.{suffix}"
            w = tensors[key]
            rows, cols = w.shape
            grid = (-(-rows // block[0]), -(-cols // block[1]))
            amax = np.array([[np.abs(w[i * block[0]:(i + 1) * block[0],
                                       j * block[1]:(j + 1) * block[1]]).max()
                              for j in range(grid[1])] for i in range(grid[0])])
            # UE8M0: the power-of-two scale 2 ** ceil(log2(amax / 448)) of each tile
            scale = np.exp2(np.ceil(np.log2(np.maximum(amax, 1e-30) / 448.0))).astype(np.float32)
            full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :cols]
            codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
            tensors[key] = codes
            tensors[key.removesuffix(".weight") + ".scale"] = scale.astype(ml_dtypes.float8_e8m0fnu)
            oracle[("mtp", k, *path)] = (codes.astype(np.float64) * full).astype(np.float32)
    quant = tmp_path / "release-fp8"
    quant.mkdir()
    save_file(tensors, str(quant / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps(dict(hf, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
        "weight_block_size": list(block)})))
    with open_v4_checkpoint(quant) as ckpt:
        assert ckpt.layout == "deepseek" and ckpt.mtp_depths == [0, 1] and ckpt.ignored == []
        assert ckpt.quantized == {"fp8": 2 * len(MTP_FP8), "mxfp4": 0}
        assert ckpt.dtype("model.mtp.1.e_proj.weight") == np.float32
        assert "mtp.1.e_proj.scale" in ckpt.disk_keys("model.mtp.1.e_proj.weight")
    back = _flat(load_hf(quant, dtype=jnp.float32))
    want = _flat(model)
    assert sorted(back) == sorted(want)
    for p, value in want.items():
        if p in oracle:
            np.testing.assert_array_equal(back[p], oracle[p], err_msg=str(p))
            assert not np.array_equal(back[p], value)  # it really was quantised
        else:
            np.testing.assert_array_equal(back[p], value, err_msg=str(p))
    assert len(oracle) == 2 * len(MTP_FP8)
