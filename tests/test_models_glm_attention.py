"""Tests for jax_dsa.models.glm.attention: the absorbed DSA layer against an independent NumPy
float64 re-implementation of UN-absorbed MLA (per-head k_nope / v expanded through kv_b_proj, as in
transformers' DeepseekV3Attention), for given, dense and indexer-chosen slot lists, plus the layer's
indexer KL loss and argument checks.

Helpers ``small_config``, ``randomize``, ``np_params``, ``np_mla`` are also used by
tests/test_models_glm_indexer.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.glm.attention import DSAAttention
from test_nn_rope import np_inv_freq, np_rope

FAMILIES = ("glm5", "deepseek-v3.2")


def small_config(family, **kw):
    """A very small config of one family (GLM: interleaved indexer RoPE, plain RoPE; V3.2:
    half-split indexer RoPE, YaRN with mscale)."""
    base = get_config(f"{family}-tiny")
    fields = dict(
        hidden_size=32, num_attention_heads=3, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=2,
        index_head_dim=16, index_topk=5, num_hidden_layers=1, indexer_types=None,
        intermediate_size=48, vocab_size=64,
    )
    fields.update(kw)
    return dataclasses.replace(base, **fields)


def randomize(module, seed):
    """Give every parameter O(1)-effect random values (norm weights near 1, nonzero biases) so
    that attention is far from uniform and every weight matters. NumPy RNG: no compiles."""
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    new = []
    for path, leaf in leaves:
        names = [str(getattr(p, "key", p)) for p in path]
        z = rng.standard_normal(leaf.shape)
        if "bias" in names:
            z = 0.3 * z
        elif leaf.ndim == 1:
            z = 1.0 + 0.3 * z
        else:
            z = z * leaf.shape[-1] ** -0.5 * 1.5
        new.append(jnp.asarray(z, leaf.dtype))
    nnx.update(module, jax.tree_util.tree_unflatten(treedef, new))


def _p(v):
    return np.asarray(v[...], np.float64)


def np_params(attn):
    return dict(
        q_a=_p(attn.q_a_proj.weight), q_a_norm=_p(attn.q_a_layernorm.weight),
        q_b=_p(attn.q_b_proj.weight), kv_a=_p(attn.kv_a_proj_with_mqa.weight),
        kv_a_norm=_p(attn.kv_a_layernorm.weight), kv_b=_p(attn.kv_b_proj.weight),
        o=_p(attn.o_proj.weight),
    )


def np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_mla(p, c, x, pos, indices):
    """Un-absorbed MLA over each query's slot list, float64.

    Returns ``(out [B, S, hidden], probs)`` with ``probs[b][t]`` an ``[H, n_valid]`` array of
    attention probabilities and ``sel[b][t]`` the valid slots, for the KL check.
    """
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    h, nope, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    inv = np_inv_freq(c.rope_parameters, rope)
    scale = c.rope_parameters.cos_sin_scale
    c_q = np_rms(x @ p["q_a"].T, p["q_a_norm"], 1e-6)  # HF latent norms: eps 1e-6
    q = (c_q @ p["q_b"].T).reshape(b, s, h, nope + rope)
    q_nope, q_pe = q[..., :nope], np_rope(q[..., nope:], pos, inv, c.rope_interleave, scale)
    ckv = x @ p["kv_a"].T
    c_kv = np_rms(ckv[..., : c.kv_lora_rank], p["kv_a_norm"], 1e-6)
    k_pe = np_rope(ckv[..., c.kv_lora_rank :], pos, inv, c.rope_interleave, scale)
    kvb = (c_kv @ p["kv_b"].T).reshape(b, s, h, nope + v)
    k_nope, val = kvb[..., :nope], kvb[..., nope:]
    out = np.zeros((b, s, h, v))
    probs, sels = [], []
    for bi in range(b):
        probs.append([]), sels.append([])
        for t in range(s):
            sel = [int(j) for j in indices[bi, t] if 0 <= j < s]
            sels[-1].append(sel)
            if not sel:
                probs[-1].append(np.zeros((h, 0)))
                continue
            logits = np.einsum("hd,khd->hk", q_nope[bi, t], k_nope[bi, sel])
            logits += np.einsum("hd,kd->hk", q_pe[bi, t], k_pe[bi, sel])
            logits *= c.softmax_scale
            e = np.exp(logits - logits.max(-1, keepdims=True))
            pr = e / e.sum(-1, keepdims=True)
            probs[-1].append(pr)
            out[bi, t] = np.einsum("hk,khv->hv", pr, val[bi, sel])
    return out.reshape(b, s, h * v) @ p["o"].T, probs, sels


def run(layer, *args, **kwargs):
    """``layer(*args, **kwargs)`` under one ``nnx.jit`` (one compile beats op-by-op dispatch)."""
    return nnx.jit(lambda m, *a: m(*a, **kwargs))(layer, *args)


def make_layer(c, seed=0, layer_idx=0):
    layer = DSAAttention(c, layer_idx, rngs=nnx.Rngs(seed))
    randomize(layer, seed + 100)
    return layer


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def random_visible_indices(rng, b, s, k):
    """Per query, up to k distinct visible keys (<= t) in random slot order, -1 elsewhere."""
    idx = -np.ones((b, s, k), np.int32)
    for bi in range(b):
        for t in range(s):
            n = min(k - 1 if t % 3 == 0 else k, t + 1)  # some rows keep a -1 slot
            chosen = rng.choice(t + 1, size=n, replace=False)
            slots = rng.permutation(k)[:n]
            idx[bi, t, slots] = chosen
    return idx


@pytest.mark.parametrize("family", FAMILIES)
def test_absorbed_equals_unabsorbed_given_indices(family):
    c = small_config(family)
    layer = make_layer(c)
    rng = np.random.default_rng(0)
    b, s = 2, 12
    x = rng.standard_normal((b, s, c.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32) + 150, (b, s))  # past YaRN's 128
    idx = random_visible_indices(rng, b, s, 6)
    kw = dict(compute_indexer_loss=False)
    out, aux = run(layer, jnp.asarray(x), jnp.asarray(pos), indices=jnp.asarray(idx), **kw)
    want, _, _ = np_mla(np_params(layer), c, x, pos, idx)
    assert out.shape == (b, s, c.hidden_size) and out.dtype == jnp.float32
    assert rel_err(out, want) < 2e-5
    np.testing.assert_array_equal(np.asarray(aux["indices"]), idx)
    # Sensitivity: dropping one slot per row changes the result far beyond the tolerance.
    idx2 = idx.copy()
    idx2[:, 1:, 0] = -1
    out2, _ = run(layer, jnp.asarray(x), jnp.asarray(pos), indices=jnp.asarray(idx2), **kw)
    assert rel_err(out2, want) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_mode_equals_dense_causal_attention(family):
    c = small_config(family)
    layer = make_layer(c, seed=1)
    rng = np.random.default_rng(1)
    b, s = 2, 10
    x = rng.standard_normal((b, s, c.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    out, aux = run(layer, jnp.asarray(x), attention_mode="dense")
    causal = np.where(np.arange(s)[None, :] <= np.arange(s)[:, None], np.arange(s)[None, :], -1)
    want, probs, sels = np_mla(np_params(layer), c, x, pos, np.broadcast_to(causal, (b, s, s)))
    assert rel_err(out, want) < 2e-5
    assert aux["indices"] is None  # dense mode builds no slot list (dense_mla)


def np_index_scores(layer, c, x, pos):
    """Index scores I[b, t, s] in float64 from the layer's parameters."""
    p = np_params(layer)
    ix = layer.indexer
    x = np.asarray(x, np.float64)
    b, s, _ = x.shape
    r = c.qk_rope_head_dim
    inv = np_inv_freq(c.rope_parameters, r)
    scale = c.rope_parameters.cos_sin_scale
    c_q = np_rms(x @ p["q_a"].T, p["q_a_norm"], 1e-6)  # HF latent norms: eps 1e-6
    q = (c_q @ _p(ix.wq_b.weight).T).reshape(b, s, c.index_n_heads, c.index_head_dim)
    q[..., :r] = np_rope(q[..., :r], pos, inv, c.indexer_rope_interleave, scale)
    k = x @ _p(ix.wk.weight).T
    mu, var = k.mean(-1, keepdims=True), k.var(-1, keepdims=True)
    k = (k - mu) / np.sqrt(var + 1e-6) * _p(ix.k_norm.weight) + _p(ix.k_norm.bias)
    k[..., :r] = np_rope(k[..., :r], pos, inv, c.indexer_rope_interleave, scale)
    w = (x @ _p(ix.weights_proj.weight).T) * c.index_n_heads**-0.5 * c.index_head_dim**-0.5
    dots = np.einsum("bthd,bsd->bths", q, k)
    return np.einsum("bth,bths->bts", w, np.maximum(dots, 0)), (q, k, w)


def np_kl(p_rows, scores_rows):
    """Mean over rows of KL(mean_h p || softmax(scores)) over each row's support."""
    kls = []
    for pr, sc in zip(p_rows, scores_rows):
        if pr.shape[1] == 0:
            continue
        target = pr.mean(0)
        log_pi = sc - sc.max() - np.log(np.sum(np.exp(sc - sc.max())))
        kls.append(np.sum(target * (np.log(target) - log_pi)))
    return float(np.mean(kls))


@pytest.mark.parametrize("family", FAMILIES)
def test_indexer_loss_dense_and_sparse(family):
    """The layer's KL loss against the un-absorbed NumPy attention probabilities and NumPy index
    scores: dense form over all visible keys, sparse form over the selected slots."""
    c = small_config(family)
    layer = make_layer(c, seed=2)
    rng = np.random.default_rng(2)
    b, s = 2, 10
    x = rng.standard_normal((b, s, c.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    scores, _ = np_index_scores(layer, c, x, pos)
    causal = np.where(np.arange(s)[None, :] <= np.arange(s)[:, None], np.arange(s)[None, :], -1)
    for mode in ("dense", "sparse"):
        _, aux = run(layer, jnp.asarray(x), attention_mode=mode)
        # dense mode: every visible key (the layer builds no list)
        idx = np.broadcast_to(causal, (b, s, s)) if mode == "dense" else np.asarray(aux["indices"])
        _, probs, sels = np_mla(np_params(layer), c, x, pos, idx)
        rows_p = [probs[bi][t] for bi in range(b) for t in range(s)]
        rows_s = [scores[bi, t, sels[bi][t]] for bi in range(b) for t in range(s)]
        want = np_kl(rows_p, rows_s)
        assert want > 1e-3  # a real, non-trivial value
        assert float(aux["indexer_loss"]) == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert aux["indexer_loss"].dtype == jnp.float32


def test_shared_layer_has_no_indexer_and_needs_indices():
    c = small_config("glm5.2", num_hidden_layers=2, index_topk_freq=2, index_skip_topk_offset=1)
    assert c.indexer_types == ("full", "shared")
    layer = DSAAttention(c, 1, rngs=nnx.Rngs(0))
    assert layer.indexer is None
    paths = [path for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))]
    assert not any("indexer" in str(path) for path in paths)
    x = jnp.ones((1, 4, c.hidden_size))
    with pytest.raises(ValueError, match="shared"):
        layer(x)
    out, aux = run(layer, x, attention_mode="dense")  # dense needs no top-k
    assert out.shape == x.shape and aux["indexer_loss"] is None


def test_parameter_shapes_and_axes():
    """HF names, PyTorch [out, in] layouts and logical axis names."""
    c = small_config("glm5")
    layer = DSAAttention(c, 0, rngs=nnx.Rngs(0))
    h, hid, r = c.num_attention_heads, c.hidden_size, c.qk_rope_head_dim
    nope, v, hi, di = c.qk_nope_head_dim, c.v_head_dim, c.index_n_heads, c.index_head_dim
    flat = {
        ".".join(str(k) for k in path): x
        for path, x in nnx.to_flat_state(nnx.state(layer, nnx.Param))
    }
    expected = {
        "q_a_proj.weight": ((c.q_lora_rank, hid), ("q_lora", "embed")),
        "q_a_layernorm.weight": ((c.q_lora_rank,), ("q_lora",)),
        "q_b_proj.weight": ((h * c.qk_head_dim, c.q_lora_rank), ("heads", "q_lora")),
        "kv_a_proj_with_mqa.weight": ((c.kv_lora_rank + r, hid), ("kv_lora", "embed")),
        "kv_a_layernorm.weight": ((c.kv_lora_rank,), ("kv_lora",)),
        "kv_b_proj.weight": ((h * (nope + v), c.kv_lora_rank), ("heads", "kv_lora")),
        "o_proj.weight": ((hid, h * v), ("embed", "heads")),
        "indexer.wq_b.weight": ((hi * di, c.q_lora_rank), ("index_heads", "q_lora")),
        "indexer.wk.weight": ((di, hid), ("index_head_dim", "embed")),
        "indexer.k_norm.weight": ((di,), ("index_head_dim",)),
        "indexer.k_norm.bias": ((di,), ("index_head_dim",)),
        "indexer.weights_proj.weight": ((hi, hid), ("index_heads", "embed")),
    }
    assert set(flat) == set(expected)
    for name, (shape, axes) in expected.items():
        assert flat[name].shape == shape, name
        assert flat[name].get_metadata()["out_sharding"] == axes, name


def test_bfloat16_compute_close_to_float32():
    c = small_config("glm5")
    f32 = make_layer(c, seed=3)
    bf16 = DSAAttention(c, 0, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
    nnx.update(bf16, nnx.state(f32, nnx.Param))
    x = jax.random.normal(jax.random.key(0), (1, 8, c.hidden_size))
    a, _ = run(f32, x, attention_mode="dense")
    b, aux = run(bf16, x.astype(jnp.bfloat16), attention_mode="dense")
    assert b.dtype == jnp.bfloat16 and jnp.isfinite(aux["indexer_loss"])
    assert rel_err(b, np.asarray(a, np.float64)) < 5e-2


def test_argument_errors():
    c = small_config("glm5")
    layer = DSAAttention(c, 0, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 5, c.hidden_size))
    with pytest.raises(ValueError, match="attention_mode"):
        layer(x, attention_mode="full")
    with pytest.raises(ValueError, match="positions"):
        layer(x, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="segment_ids"):
        layer(x, segment_ids=jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match="hidden_size"):
        layer(jnp.ones((2, 5, 7)))
    with pytest.raises(ValueError, match="indices"):
        layer(x, indices=jnp.zeros((2, 4, 3), jnp.int32))


def _indexer_cuda_built():
    from jax_dsa import _native
    return _native.loaded("_cuda") and _native.loaded("_cuda_indexer")


@pytest.mark.skipif(not _indexer_cuda_built(), reason="needs the _cuda and _cuda_indexer modules")
def test_training_step_lowers_to_the_cuda_kernels_by_default(monkeypatch):
    """implementation=None on a GPU: the CUDA lowering of a sparse-mode training step calls the
    attention kernels (and the forward's target mode) and the indexer's top-k, score and KL
    backward kernels, and XLA gathers no float
    ``[S, K, .]`` rows (checked on the host by pretending the default backend is a GPU)."""
    import types

    from jax_dsa.ops import registry
    from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
    from jax_dsa.ops.indexer.topk import cuda as topk_cuda
    from jax_dsa.ops.sparse_mla import cuda as sparse_mla_cuda

    sm90 = types.SimpleNamespace(compute_capability="9.0")
    monkeypatch.setattr(registry, "jax", types.SimpleNamespace(default_backend=lambda: "gpu",
                                                               devices=lambda *a: [sm90]))
    k = 96  # distinctive: no other dim of the layer has this size
    c = small_config("glm5", hidden_size=64, num_attention_heads=4, kv_lora_rank=512,
                     qk_rope_head_dim=64, index_n_heads=8, index_head_dim=128, index_topk=k)
    layer = DSAAttention(c, 0, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jax.ShapeDtypeStruct((2, 128, c.hidden_size), jnp.bfloat16)

    def loss(p, x):
        y, aux = nnx.merge(graphdef, p, rest)(x)
        return jnp.mean(y.astype(jnp.float32) ** 2) + aux["indexer_loss"]

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).lower(
        lowering_platforms=("cuda",)).as_text()
    # the KL target from the attention kernel's target mode (the layer passes sparse_mla's lse),
    # the index scores from the top-k (no score kernel)
    for target in (sparse_mla_cuda.CUDA_FWD_TARGET, sparse_mla_cuda.CUDA_BWD_TARGET,
                   topk_cuda.TARGET, sparse_mla_cuda.CUDA_TARGET_TARGET, kl_loss_cuda.BWD_TARGET):
        assert f"@{target}(" in text, target
    for target in (kl_loss_cuda.FWD_TARGET, kl_loss_cuda.SCORE_TARGET):
        assert f"@{target}(" not in text, target
    for line in text.splitlines():
        if "stablehlo.gather" in line and f"x{k}x" in line:
            assert "bf16" not in line and "f32" not in line, line


def test_a_cuda_layer_falls_back_where_the_indexer_kernels_do_not_fit():
    """implementation="cuda" on a layer: the dense KL form (warm-up) and an indexer the kernels are
    not compiled for (index_head_dim 64) run their indexer ops on "xla" instead of failing."""
    c = small_config("glm5", hidden_size=64, num_attention_heads=4, kv_lora_rank=512,
                     qk_rope_head_dim=64, index_head_dim=64)
    layer = DSAAttention(c, 0, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, 64, c.hidden_size), jnp.bfloat16)
    for mode in ("dense", "sparse"):
        out, aux = jax.eval_shape(
            lambda x, mode=mode: layer(x, attention_mode=mode, implementation="cuda"), x)
        assert out.shape == x.shape and aux["indexer_loss"].shape == ()


@pytest.mark.gpu
@pytest.mark.parametrize("mode,s", [("sparse", 16384), ("sparse", 65536), ("dense", 4096)])
def test_gpu_deterministic_layer_step_repeats_bitwise(mode, s):
    """deterministic=True: a GLM-5-dims layer's training step (the indexer KL loss included,
    every op on "cuda") gives bitwise identical gradients in two runs, and the default step's
    gradients within bf16 tolerance."""
    attn = DSAAttention(get_config("glm5"), 0, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                        param_dtype=jnp.bfloat16)
    graphdef, params, rest = nnx.split(attn, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (1, s, attn.config.hidden_size), jnp.bfloat16)

    def grads(p, x, det):
        def loss(p, x):
            y, aux = nnx.merge(graphdef, p, rest)(x, attention_mode=mode, implementation="cuda",
                                                  deterministic=det)
            return jnp.mean(y.astype(jnp.float32) ** 2) + aux["indexer_loss"]
        return jax.grad(loss, argnums=(0, 1))(p, x)

    grads = jax.jit(grads, static_argnums=2)
    first, second, default = grads(params, x, True), grads(params, x, True), grads(params, x, False)
    for a, b, d in zip(jax.tree.leaves(first), jax.tree.leaves(second), jax.tree.leaves(default)):
        a, b, d = (np.asarray(v, np.float32) for v in (a, b, d))
        np.testing.assert_array_equal(a, b)
        assert np.all(np.isfinite(a))
        assert np.linalg.norm(a - d) <= 2e-2 * np.linalg.norm(d) + 1e-30
