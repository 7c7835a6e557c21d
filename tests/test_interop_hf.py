"""Parity of jax_dsa.interop with transformers' own GLM-5 / GLM-5.2 / DeepSeek V3.2 models.

The reference runs in a separate interpreter with torch (CPU) and transformers (``.venv-hf``,
made by scripts/setup.sh; or ``$JAX_DSA_HF_PYTHON``) through tests/hf_reference/hf_reference.py:
it builds tiny random models, saves them with ``save_pretrained`` and records float32 logits,
each layer's attention input / output and each indexer's top-k (eager attention, where
transformers realises the sparsity as an additive mask from the indexer's top-k). The tests skip
when that interpreter is missing.

Error measure: ``max |jax - ref| / max |ref|`` over the whole tensor; tolerance 1e-4.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import DSAConfig, RopeParameters
from jax_dsa.interop import config_from_hf, load_hf, load_hf_attention, load_hf_config, save_hf
from jax_dsa.nn import DSAAttention, DSALanguageModel
from jax_dsa.nn.rope import rope_cos_sin

ROOT = Path(__file__).resolve().parents[1]
HF_PYTHON = Path(os.environ.get("JAX_DSA_HF_PYTHON", ROOT / ".venv-hf" / "bin" / "python"))
SCRIPT = ROOT / "tests" / "hf_reference" / "hf_reference.py"
TOL = 1e-4
SEQ, TOPK, BATCH, VOCAB = 40, 16, 2, 128

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    index_topk=TOPK, index_head_dim=16, index_n_heads=16, max_position_embeddings=128,
)
# name -> (model_type, HF config kwargs, save_pretrained max_shard_size)
MODELS = {
    # GLM-5: every layer runs its indexer (interleaved indexer RoPE); layer 0 dense MLP, 1 MoE.
    "glm5": ("glm_moe_dsa", dict(_COMMON, num_hidden_layers=2, first_k_dense_replace=1), "100KB"),
    # GLM-5.2 IndexShare: layers full, shared, full; explicit mlp_layer_types; attention biases;
    # tied embeddings.
    "glm5.2": ("glm_moe_dsa", dict(
        _COMMON, num_hidden_layers=3, index_topk_freq=2, index_skip_topk_offset=1,
        mlp_layer_types=["dense", "sparse", "dense"], attention_bias=True,
        tie_word_embeddings=True,
    ), None),
    # DeepSeek V3.2: half-split indexer RoPE, YaRN with mscale != mscale_all_dim (both the
    # cos/sin factor and the softmax mscale differ from 1), group-limited routing.
    "deepseek-v3.2": ("deepseek_v32", dict(
        _COMMON, num_hidden_layers=2, first_k_dense_replace=1, n_group=4, topk_group=2,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                             mscale=1.0, mscale_all_dim=0.8),
    ), None),
}


def _input_ids():
    return np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32)


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _run_reference(job: dict, workdir: Path):
    if not HF_PYTHON.exists():
        pytest.skip(f"no reference interpreter at {HF_PYTHON}: run scripts/setup.sh (it makes "
                    ".venv-hf with torch and transformers) or set JAX_DSA_HF_PYTHON")
    job_file = workdir / f"job-{len(list(workdir.glob('job-*.json')))}.json"
    job_file.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(HF_PYTHON), str(SCRIPT), str(job_file)], capture_output=True,
                          text=True, timeout=600, env=env)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, f"reference failed:\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Checkpoints and reference outputs of every model in MODELS (one reference process)."""
    work = tmp_path_factory.mktemp("hf")
    ids = _input_ids().tolist()
    job = {"make": [], "runs": []}
    out = {}
    for seed, (name, (model_type, cfg, shard)) in enumerate(MODELS.items()):
        ckpt = work / f"{name}-ckpt"
        job["make"].append({"model_type": model_type, "config": cfg, "out": str(ckpt),
                            "seed": seed, "max_shard_size": shard})
        job["runs"].append({"ckpt": str(ckpt), "input_ids": ids, "out": str(work / f"{name}.npz")})
        # index_topk >= S: transformers' indexer keeps every key (dense attention).
        job["runs"].append({"ckpt": str(ckpt), "input_ids": ids,
                            "out": str(work / f"{name}-dense.npz"),
                            "config_overrides": {"index_topk": 4 * SEQ}})
        out[name] = dict(ckpt=ckpt, ref=work / f"{name}.npz", dense=work / f"{name}-dense.npz")
    _run_reference(job, work)
    for name in out:
        out[name]["ref"] = dict(np.load(out[name]["ref"]))
        out[name]["dense"] = dict(np.load(out[name]["dense"]))
    return out


_forward = nnx.jit(
    lambda model, ids, mode: model(ids, attention_mode=mode, compute_indexer_loss=False)[0],
    static_argnums=2,
)


@pytest.mark.parametrize("name", list(MODELS))
def test_config_maps_like_transformers(reference, name):
    ckpt = reference[name]["ckpt"]
    hf = json.loads((ckpt / "config.json").read_text())
    c = load_hf_config(ckpt)
    assert c.model_type == hf["model_type"]
    assert c.mlp_layer_types == tuple(hf["mlp_layer_types"])
    expected_types = tuple(hf.get("indexer_types") or ["full"] * hf["num_hidden_layers"])
    assert c.indexer_types == expected_types
    assert c.indexer_rope_interleave == (hf["model_type"] == "glm_moe_dsa")
    rope = hf["rope_parameters"]
    scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5
    if rope["rope_type"] == "yarn":
        m = 0.1 * rope["mscale_all_dim"] * np.log(rope["factor"]) + 1.0
        scale *= m * m
        assert c.rope_parameters.cos_sin_scale != 1.0
    assert np.isclose(c.softmax_scale, scale, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(reference, name):
    r = reference[name]
    model = load_hf(r["ckpt"], dtype=jnp.float32)
    ids = jnp.asarray(_input_ids())
    sparse = np.asarray(_forward(model, ids, "sparse"))
    assert sparse.shape == (BATCH, SEQ, VOCAB)
    err = _rel(sparse, r["ref"]["logits"])
    assert err <= TOL, f"{name}: sparse logits rel error {err:.2e}"
    # The top-k choice matters: transformers' own sparse and dense (index_topk >= S) logits
    # differ by far more than the tolerance.
    gap = _rel(r["ref"]["logits"], r["dense"]["logits"])
    print(f"{name}: logits rel error {err:.1e}; transformers sparse vs dense {gap:.2f}")
    assert gap > 100 * TOL, f"{name}: sparse vs dense only {gap:.2e} apart"


def test_dense_mode_matches_transformers_dense(reference):
    """attention_mode="dense" (the warm-up stage) is transformers with index_topk >= S."""
    r = reference["glm5"]
    dense = np.asarray(_forward(load_hf(r["ckpt"], dtype=jnp.float32), jnp.asarray(_input_ids()),
                                "dense"))
    err = _rel(dense, r["dense"]["logits"])
    print(f"glm5 dense mode: logits rel error {err:.1e}")
    assert err <= TOL, f"dense logits rel error {err:.2e}"


def _visible_sets(indices, hf: bool):
    """Per (row, query) the set of chosen visible keys (transformers' raw top-k also lists
    masked keys > t for t < K; jax_dsa pads with -1)."""
    b, s, _ = indices.shape
    return [[frozenset(int(j) for j in indices[bi, t] if (j <= t if hf else j >= 0))
             for t in range(s)] for bi in range(b)]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_attention_layer_matches(reference, name):
    """Each layer's attention (loaded alone with load_hf_attention) on transformers' own layer
    input: same top-k sets and the same output."""
    r = reference[name]
    config = load_hf_config(r["ckpt"])
    shared = None
    for i in range(config.num_hidden_layers):
        state = load_hf_attention(r["ckpt"], i, dtype=jnp.float32)
        attn = DSAAttention(config, i, rngs=nnx.Rngs(0))
        nnx.update(attn, state)
        x = jnp.asarray(r["ref"][f"attn_in_{i}"])
        if config.has_indexer(i):
            out, aux = attn(x, compute_indexer_loss=False)
            shared = aux["indices"]
            ours = _visible_sets(np.asarray(aux["indices"]), hf=False)
            theirs = _visible_sets(r["ref"][f"topk_{i}"], hf=True)
            assert ours == theirs, f"{name} layer {i}: top-k sets differ"
        else:
            assert attn.indexer is None and f"topk_{i}" not in r["ref"]
            out, _ = attn(x, indices=shared, compute_indexer_loss=False)
        err = _rel(out, r["ref"][f"attn_out_{i}"])
        print(f"{name} layer {i} ({config.indexer_types[i]}): attention rel error {err:.1e}")
        assert err <= TOL, f"{name} layer {i}: attention output rel error {err:.2e}"


def test_one_changed_slot_is_visible(reference):
    """Replacing the weakest chosen key of each row (that has a choice) by the best unchosen one
    changes the attention output by far more than the tolerance: the parity above pins down the
    exact top-k, not just something close to it."""
    r = reference["glm5"]
    config = load_hf_config(r["ckpt"])
    attn = DSAAttention(config, 0, rngs=nnx.Rngs(0))
    nnx.update(attn, load_hf_attention(r["ckpt"], 0, dtype=jnp.float32))
    x = jnp.asarray(r["ref"]["attn_in_0"])
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    cos, sin = rope_cos_sin(positions, config.rope_parameters, config.qk_rope_head_dim)
    _, _, _, c_q = attn.absorbed_qkv(x, cos, sin)
    q, k, w = (np.asarray(a, np.float64) for a in attn.indexer(x, c_q, cos, sin))
    score = np.einsum("bsh,bsht->bst", w, np.maximum(np.einsum("bshd,btd->bsht", q, k), 0))
    out_ref, aux = attn(x, compute_indexer_loss=False)
    idx = np.array(aux["indices"])
    changed = 0
    for b in range(BATCH):
        for t in range(TOPK, SEQ):  # rows with more visible keys than slots
            chosen = idx[b, t]
            rest = np.setdiff1d(np.arange(t + 1), chosen)
            weakest = np.argmin(score[b, t, chosen])
            idx[b, t, weakest] = rest[np.argmax(score[b, t, rest])]
            changed += 1
    out, _ = attn(x, indices=jnp.asarray(idx), compute_indexer_loss=False)
    assert changed == BATCH * (SEQ - TOPK)
    print(f"one slot changed per row: attention output moves by {_rel(out, out_ref):.2f}")
    assert _rel(out, out_ref) > 100 * TOL


def _random_model(config, seed):
    """A DSALanguageModel with NumPy-random weights (linear ~ N(0, 1/fan_in), norms ~ 1 +
    N(0, 0.01), biases ~ N(0, 0.01), embeddings ~ N(0, 1)), built without per-initialiser
    compiles."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DSALanguageModel(config, rngs=nnx.Rngs(0))))
    flat = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = var.get_value().shape, var.get_value().dtype
        if len(shape) == 1:
            x = (path[-1] == "weight") + 0.1 * rng.standard_normal(shape)
        else:
            x = rng.standard_normal(shape) / np.sqrt(1 if path[0] == "embed_tokens" else shape[-1])
        flat.append((path, var.replace(jnp.asarray(x, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.fixture(scope="session")
def roundtrip(reference, tmp_path_factory):
    """jax_dsa-saved checkpoints, evaluated by transformers: every reference model after
    load_hf -> save_hf, and a model initialised in jax_dsa (all-dense MLPs)."""
    work = tmp_path_factory.mktemp("roundtrip")
    ids = _input_ids()
    job = {"runs": []}
    out = {}
    for name, r in reference.items():
        saved = work / name
        save_hf(load_hf(r["ckpt"], dtype=jnp.float32), saved,
                max_shard_size="64KB" if name == "glm5" else "5GB")
        job["runs"].append({"ckpt": str(saved), "input_ids": ids.tolist(),
                            "out": str(work / f"{name}.npz")})
        out[name] = work / f"{name}.npz"
    native = DSAConfig(
        model_type="glm_moe_dsa", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        index_topk=TOPK, index_n_heads=16, index_head_dim=16,
        rope_parameters=RopeParameters(rope_theta=10000.0), max_position_embeddings=128,
    )
    model = _random_model(native, seed=7)
    save_hf(model, work / "native")
    job["runs"].append({"ckpt": str(work / "native"), "input_ids": ids.tolist(),
                        "out": str(work / "native.npz")})
    _run_reference(job, work)
    logits = np.asarray(_forward(model, jnp.asarray(ids), "sparse"))
    return {name: dict(np.load(p)) for name, p in out.items()} | {
        "native": (logits, dict(np.load(work / "native.npz")), work / "native")
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_save_hf_gives_transformers_identical_logits(reference, roundtrip, name):
    np.testing.assert_array_equal(roundtrip[name]["logits"], reference[name]["ref"]["logits"])


def test_save_hf_of_a_jax_model(roundtrip):
    logits, ref, path = roundtrip["native"]
    err = _rel(logits, ref["logits"])
    print(f"jax-initialised model saved with save_hf: logits rel error {err:.1e}")
    assert err <= TOL, f"jax-initialised model: rel error {err:.2e} against transformers"
    hf = json.loads((path / "config.json").read_text())
    assert hf["mlp_layer_types"] == ["dense", "dense"]
    assert config_from_hf(hf).mlp_layer_types == ("dense", "dense")
