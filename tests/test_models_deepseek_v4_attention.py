"""Tests for jax_dsa.models.deepseek_v4.attention: parity with transformers' DeepseekV4Attention for
every layer type, packed documents, slot lists, and where the gradients go.

The reference runs in a separate interpreter with torch (CPU) and transformers 5.24 (``.venv-hf``
at the repository root, or ``$JAX_DSA_HF_PYTHON``) through
tests/hf_reference_v4/v4_attention_reference.py: random weights (sinks and position biases
included), random hidden states, eager attention in float32. The parity tests skip when that
interpreter is missing. Error measure: ``max |jax - ref| / max |ref|``; tolerance 1e-4.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4 import attention as v4_attention
from jax_dsa.models.deepseek_v4.attention import (
    DeepseekV4Attention,
    GroupedLinear,
    unweighted_rms_norm,
)
from jax_dsa.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config

ROOT = Path(__file__).resolve().parents[1]
HF_PYTHON = Path(os.environ.get("JAX_DSA_HF_PYTHON", ROOT / ".venv-hf" / "bin" / "python"))
SCRIPT = ROOT / "tests" / "hf_reference_v4" / "v4_attention_reference.py"
TOL = 1e-4
# DeepSeek's own names of a CSA layer's attention parameters
# (jax_dsa.models.deepseek_v4.checkpoint.ORIGINAL_NAMES).
_ORIGINAL_NAMES = [
    "wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight", "wo_a.weight",
    "wo_b.weight", "attn_sink", "compressor.wkv.weight", "compressor.wgate.weight",
    "compressor.ape", "compressor.norm.weight", "indexer.compressor.wkv.weight",
    "indexer.compressor.wgate.weight", "indexer.compressor.ape", "indexer.compressor.norm.weight",
    "indexer.wq_b.weight", "indexer.weights_proj.weight",
]

_TINY_HF = {
    "vocab_size": 256, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 64, "q_lora_rank": 64, "partial_rotary_factor": 0.25, "o_groups": 2,
    "o_lora_rank": 32, "index_n_heads": 16, "index_head_dim": 32, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 4096,
    "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "layer_types": [SLIDING, CSA, HCA],
}
# 16 index heads: with few heads, several compressed entries often score exactly 0 (every head's
# ReLU is 0) and the top-k boundary falls in a tie, which torch.topk breaks arbitrarily.
SPECS = [
    # Small ratios: a 256-token row has 64 CSA entries (top 16 chosen) and 16 HCA entries, and the
    # 32-token window is a small part of each row.
    {"name": "small-rates", "seed": 1, "batch": 2, "seq_len": 256,
     "original_names": [f"layers.1.attn.{v}" for v in _ORIGINAL_NAMES],
     "hf_config": dict(
        _TINY_HF, sliding_window=32, index_topk=16,
        compress_rates={CSA: 4, HCA: 16},
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32,
                         "beta_slow": 1},
    )},
    # V4's own ratios (4 / 128) and window (128); 160 CSA entries (top 48), 4 HCA entries.
    {"name": "v4-rates", "seed": 2, "batch": 1, "seq_len": 600, "hf_config": dict(
        _TINY_HF, sliding_window=128, index_topk=48,
        compress_rates={CSA: 4, HCA: 128},
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
    )},
]


@functools.partial(nnx.jit, static_argnames=("mode", "loss"))
def _apply(attn, x, positions=None, segment_ids=None, mode="sparse", loss=True):
    """The layer under jit (one compile per shape; eager dispatch is slow on a busy CPU)."""
    return attn(x, positions, segment_ids, attention_mode=mode, compute_indexer_loss=loss)


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not HF_PYTHON.exists():
        pytest.skip(f"no reference interpreter at {HF_PYTHON}: create .venv-hf (Python 3.11 with "
                    "torch and transformers 5.24) or set JAX_DSA_HF_PYTHON")
    work = tmp_path_factory.mktemp("hf_v4")
    (work / "specs.json").write_text(json.dumps(SPECS))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(HF_PYTHON), str(SCRIPT), str(work / "specs.json"), str(work)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"reference failed:\n{proc.stderr[-4000:]}"
    return {s["name"]: dict(np.load(work / f"{s['name']}.npz")) for s in SPECS}



def _load_layer(config, layer, arrays):
    """A DeepseekV4Attention with the reference's weights; checks the names match both ways."""
    attn = DeepseekV4Attention(config, layer, rngs=nnx.Rngs(0))
    flat = dict(nnx.to_flat_state(nnx.state(attn, nnx.Param)))
    prefix = f"layers.{layer}."
    ours = set()
    for path, var in flat.items():
        key = prefix + ".".join(str(p) for p in path)
        ours.add(key)
        assert key in arrays, f"no reference tensor {key}"
        assert var.get_value().shape == arrays[key].shape, key
        var.set_value(jnp.asarray(arrays[key]))
    theirs = {k for k in arrays if k.startswith(prefix)}
    assert ours == theirs
    nnx.update(attn, nnx.from_flat_state(flat))
    return attn


@pytest.mark.parametrize("spec", [s["name"] for s in SPECS])
def test_parity_with_transformers(reference, spec):
    arrays = reference[spec]
    config = DeepseekV4Config.from_hf_dict(json.loads(str(arrays["config_json"])))
    assert config.layer_types == (SLIDING, CSA, HCA)
    x = jnp.asarray(arrays["hidden_states"])
    positions = jnp.asarray(arrays["position_ids"])
    for layer in range(config.num_hidden_layers):
        attn = _load_layer(config, layer, arrays)
        out, aux = _apply(attn, x, positions)
        err = _rel(out, arrays[f"out.{layer}"])
        print(f"{spec} layer {layer} ({attn.layer_type}): max-rel error {err:.2e}")
        assert err <= TOL, (spec, layer, attn.layer_type, err)
        if attn.layer_type == CSA:
            # The indexer must pick the same compressed entries (as sets; -1 = invalid).
            ref = arrays[f"topk.{layer}"]
            got = np.asarray(aux["topk"])
            assert got.shape == ref.shape
            assert ref.shape[-1] == config.index_topk < x.shape[1] // 4  # top-k really selects
            for g, r in zip(got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])):
                assert set(g[g >= 0].tolist()) == set(r[r >= 0].tolist())


def test_original_names_are_transformers_conversion(reference):
    """DeepSeek's checkpoint names map onto ours exactly as transformers converts them."""
    from jax_dsa.models.deepseek_v4.checkpoint import ORIGINAL_NAMES, attention_key

    assert list(ORIGINAL_NAMES.values()) == _ORIGINAL_NAMES
    renamed = json.loads(str(reference["small-rates"]["renamed_json"]))
    ours = [attention_key(k.split("."), 1) for k in ORIGINAL_NAMES]
    assert ["model." + r for r in renamed] == ours


@pytest.mark.parametrize("layout", ["state_dict", "save_pretrained", "deepseek"])
def test_load_hf_attention_from_checkpoint(reference, tmp_path, layout):
    """A checkpoint directory in each naming (transformers' in-memory names, its save_pretrained
    names, DeepSeek's release names) loads through jax_dsa.interop.load_hf_attention and
    reproduces transformers' output. (tests/test_models_deepseek_v4_checkpoint_layouts.py loads a
    folder written by transformers' own save_pretrained.)"""
    from jax_dsa.interop.loader import load_hf_attention
    from jax_dsa.models.deepseek_v4.checkpoint import attention_prefix
    from jax_dsa.models.deepseek_v4.checkpoint_layouts import save_pretrained_name

    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    arrays = reference["small-rates"]
    (tmp_path / "config.json").write_text(str(arrays["config_json"]))
    tensors = {}
    for key, value in arrays.items():
        if key.startswith("layers."):
            _, layer, name = key.split(".", 2)
            tensors[save_pretrained_name(attention_prefix(int(layer)) + name, layout)] = value
    sinks = {"state_dict": "model.layers.0.self_attn.sinks",
             "save_pretrained": "model.layers.0.attn.attn_sink",
             "deepseek": "layers.0.attn.attn_sink"}
    assert sinks[layout] in tensors
    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    config = DeepseekV4Config.from_hf_dict(json.loads(str(arrays["config_json"])))
    x, positions = jnp.asarray(arrays["hidden_states"]), jnp.asarray(arrays["position_ids"])
    for layer in range(config.num_hidden_layers):
        attn = DeepseekV4Attention(config, layer, rngs=nnx.Rngs(0))
        nnx.update(attn, load_hf_attention(tmp_path, layer))
        out, _ = _apply(attn, x, positions)
        assert _rel(out, arrays[f"out.{layer}"]) <= TOL


# ------------------------------------------------------------------------------------------------
# Packing, slots, modes


def _tiny(**overrides):
    return get_config("deepseek-v4-tiny", **overrides)


def _random_params(attn, seed):
    """Sinks and position biases random too (they start at zero)."""
    flat = dict(nnx.to_flat_state(nnx.state(attn, nnx.Param)))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    for k, (path, var) in zip(keys, flat.items()):
        if path[-1] in ("sinks", "position_bias"):
            value = var.get_value()
            var.set_value(jax.random.normal(k, value.shape, value.dtype))
    nnx.update(attn, nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def tiny_layers():
    c = _tiny()
    layers = []
    for i, t in enumerate(c.layer_types[:3]):
        attn = DeepseekV4Attention(c, i, rngs=nnx.Rngs(10 + i))
        _random_params(attn, i)
        layers.append(attn)
    assert [a.layer_type for a in layers] == [SLIDING, CSA, HCA]
    return c, layers


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_packed_documents_equal_documents_alone(tiny_layers, mode):
    c, layers = tiny_layers
    if mode == "dense":  # only CSA layers depend on the mode
        layers = [a for a in layers if a.layer_type == CSA]
    l1, l2, pad = 90, 70, 4  # neither a multiple of 4 or 16; 22 / 17 CSA entries > top 16
    s = l1 + l2 + pad
    x = jax.random.normal(jax.random.key(3), (1, s, c.hidden_size))
    positions = jnp.concatenate(
        [jnp.arange(l1), jnp.arange(l2), jnp.zeros(pad, jnp.int32)]
    ).astype(jnp.int32)[None]
    segments = jnp.concatenate(
        [jnp.full(l1, 1), jnp.full(l2, 2), jnp.zeros(pad, jnp.int32)]
    ).astype(jnp.int32)[None]

    @nnx.jit
    def run(attn, x, positions, segments):  # one compile for the three calls
        return (attn(x, positions, segments, attention_mode=mode),
                attn(x[:, :l1], attention_mode=mode),
                attn(x[:, l1:l1 + l2], attention_mode=mode))

    for attn in layers:
        (packed, aux), (alone1, aux1), (alone2, aux2) = run(attn, x, positions, segments)
        scale = float(jnp.abs(packed).max())
        assert float(jnp.abs(packed[:, :l1] - alone1).max()) <= 1e-5 * scale, attn.layer_type
        assert float(jnp.abs(packed[:, l1:l1 + l2] - alone2).max()) <= 1e-5 * scale
        if attn.layer_type == CSA:
            # The KL is a mean over rows that see a compressed entry: p >= m - 1 = 3.
            n1, n2 = l1 - 3, l2 - 3
            want = (float(aux1["indexer_loss"]) * n1 + float(aux2["indexer_loss"]) * n2) / (n1 + n2)
            np.testing.assert_allclose(float(aux["indexer_loss"]), want, rtol=1e-4)
        # Slot lists: the packed row's slots point into the same document only.
        idx, length = np.asarray(aux["indices"][0]), np.asarray(aux["topk_length"][0])
        seg = np.asarray(segments[0])
        pos = np.asarray(positions[0])
        for t in range(l1 + l2):
            valid = idx[t][: length[t]]
            assert (valid >= 0).all() and (idx[t][length[t]:] == -1).all()
            raw = valid[valid < s]
            assert (seg[raw] == seg[t]).all() and (raw <= t).all()
            assert len(raw) == min(pos[t] + 1, c.sliding_window)


def test_slot_lists_single_document(tiny_layers):
    """Window rows, compressed rows and widths, written out for one row."""
    c, layers = tiny_layers
    s = 96  # 24 CSA entries (top 16), 6 HCA entries
    x = jax.random.normal(jax.random.key(4), (1, s, c.hidden_size))
    _, csa, hca = layers
    for attn, mode in ((hca, "sparse"), (csa, "dense"), (csa, "sparse")):
        m = attn.compressor.ratio
        _, aux = _apply(attn, x, mode=mode, loss=False)
        idx, length = np.asarray(aux["indices"][0]), np.asarray(aux["topk_length"][0])
        assert idx.shape[-1] == attn.slot_width(s, mode) == 128
        for t in range(s):
            n_w = min(t + 1, c.sliding_window)
            np.testing.assert_array_equal(idx[t, :n_w], np.arange(t - n_w + 1, t + 1))
            comp = idx[t, n_w:length[t]] - s
            visible = (t + 1) // m
            if mode == "sparse" and attn.layer_type == CSA:
                assert len(comp) == min(c.index_topk, visible)
                assert len(set(comp.tolist())) == len(comp) and (comp < visible).all()
            else:
                np.testing.assert_array_equal(comp, np.arange(visible))
            assert (idx[t, length[t]:] == -1).all()


def test_dense_mode_equals_sparse_when_topk_covers_everything():
    c = _tiny(index_topk=64)  # 256 tokens -> 64 CSA entries: top-64 keeps all of them
    attn = DeepseekV4Attention(c, 1, rngs=nnx.Rngs(0))
    _random_params(attn, 5)
    x = jax.random.normal(jax.random.key(6), (2, 256, c.hidden_size))
    sparse, aux_s = _apply(attn, x, mode="sparse")
    dense, aux_d = _apply(attn, x, mode="dense")
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(aux_s["indexer_loss"]), float(aux_d["indexer_loss"]),
                               rtol=1e-5)


def test_unlisted_entries_equal_the_slot_list(tiny_layers, monkeypatch):
    """Past MAX_LISTED_ENTRIES (cut to 0 here) HCA and dense CSA list only the window and take
    every visible compressed row through sparse_dense_mla: the same output, indexer loss and
    parameter gradients as the [window | compressed] slot list, on packed documents (dense
    mode; HCA is the same in both modes)."""
    mode = "dense"
    c, layers = tiny_layers
    s = 96
    x = jax.random.normal(jax.random.key(8), (2, s, c.hidden_size))
    positions = jnp.asarray(np.concatenate([np.arange(40), np.arange(s - 40)]))[None].repeat(2, 0)
    segments = jnp.asarray((np.arange(s) >= 40).astype(np.int32))[None].repeat(2, 0)

    def step(attn):
        graphdef, params, rest = nnx.split(attn, nnx.Param, ...)

        def loss(p):
            out, aux = nnx.merge(graphdef, p, rest)(x, positions, segments, attention_mode=mode)
            kl = aux["indexer_loss"] if aux["indexer_loss"] is not None else 0.0
            return jnp.sum(out * jnp.cos(out)) + kl, (out, aux["indexer_loss"],
                                                      jnp.max(aux["indices"]))
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    for attn in layers[1:]:  # CSA, HCA
        (want_v, (want_out, want_kl, want_k)), want_g = step(attn)
        monkeypatch.setattr(v4_attention, "MAX_LISTED_ENTRIES", 0)
        (got_v, (got_out, got_kl, got_k)), got_g = step(attn)
        monkeypatch.undo()
        # the slot lists reach into the compressed rows (>= s) only on the listed path
        assert want_k >= s > got_k, (attn.layer_type, got_k)
        assert _rel(got_out, want_out) < 1e-5, attn.layer_type
        if want_kl is not None:
            np.testing.assert_allclose(float(got_kl), float(want_kl), rtol=1e-5)
        for (path, a), (_, b) in zip(nnx.to_flat_state(got_g), nnx.to_flat_state(want_g)):
            a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
            scale = max(float(np.abs(b).max()), 1e-30)
            assert float(np.abs(a - b).max()) <= 1e-4 * scale, (attn.layer_type, path)


def test_gradients_finite_and_indexer_isolated(tiny_layers):
    """The output's gradient never reaches the indexer; the indexer loss reaches only it."""
    c, layers = tiny_layers
    csa = layers[1]
    x = jax.random.normal(jax.random.key(7), (1, 80, c.hidden_size))
    graphdef, params, rest = nnx.split(csa, nnx.Param, ...)

    def parts(p):
        out, aux = nnx.merge(graphdef, p, rest)(x)
        return jnp.stack([jnp.sum(out * jnp.cos(out)), aux["indexer_loss"]])

    grads = jax.jit(jax.jacrev(parts))(params)  # both gradients, one compile
    g_out = jax.tree.map(lambda g: g[0], grads)
    g_loss = jax.tree.map(lambda g: g[1], grads)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_out), nnx.to_flat_state(g_loss)):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        assert np.isfinite(a).all() and np.isfinite(b).all(), path
        in_indexer = "indexer" in path
        if in_indexer:
            assert not a.any(), path
        else:
            assert not b.any(), path
            assert a.any(), path
    assert any(
        np.asarray(v.get_value()).any() for p, v in nnx.to_flat_state(g_loss) if "indexer" in p
    )


def test_grouped_linear_and_q_norm_against_numpy():
    rng = np.random.default_rng(0)
    lin = GroupedLinear(6, 8, 2, axes=("heads", "head_dim"), rngs=nnx.Rngs(0))
    x = rng.standard_normal((3, 2, 6)).astype(np.float32)
    w = np.asarray(lin.weight[...]).reshape(2, 4, 6)
    want = np.stack([x[:, g] @ w[g].T for g in range(2)], axis=1)
    np.testing.assert_allclose(np.asarray(lin(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)
    q = rng.standard_normal((5, 16))
    want = q / np.sqrt(np.mean(q**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(unweighted_rms_norm(jnp.asarray(q), 1e-6)), want,
                               rtol=1e-5)


def test_bad_inputs():
    c = _tiny()
    attn = DeepseekV4Attention(c, 0, rngs=nnx.Rngs(0))
    x = jnp.zeros((1, 8, c.hidden_size))
    with pytest.raises(ValueError, match="attention_mode"):
        attn(x, attention_mode="full")
    with pytest.raises(ValueError, match="hidden_size"):
        attn(jnp.zeros((1, 8, 3)))
    with pytest.raises(ValueError, match="positions"):
        attn(x, jnp.zeros((1, 7), jnp.int32))
    with pytest.raises(ValueError, match="layer_idx"):
        DeepseekV4Attention(c, 9, rngs=nnx.Rngs(0))
