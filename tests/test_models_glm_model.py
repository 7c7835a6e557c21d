"""Tests for jax_dsa.models.glm.model.DSALanguageModel: shapes and jit, GLM-5.2 IndexShare reuse,
packed documents, gradient separation between the LM loss and the indexer loss, and training
steps that reduce both losses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.glm.model import DSALanguageModel
from test_models_glm_attention import randomize, small_config


def lm_loss(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def is_indexer(path):
    return "indexer" in [str(getattr(p, "key", p)) for p in path]


def test_shapes_and_jit_bfloat16():
    c = small_config("glm5", num_hidden_layers=2)
    model = DSALanguageModel(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    ids = jax.random.randint(jax.random.key(0), (2, 32), 0, c.vocab_size, jnp.int32)
    f = nnx.jit(lambda m, ids: m(ids, attention_mode="sparse"))
    logits, aux = f(model, ids)
    assert logits.shape == (2, 32, c.vocab_size) and logits.dtype == jnp.float32
    assert set(aux) == {"indexer_loss", "expert_load", "expert_overflow"}
    assert aux["indexer_loss"].shape == ()
    assert aux["expert_load"] == () and aux["expert_overflow"] == ()  # the tiny presets are dense
    assert aux["indexer_loss"].dtype == jnp.float32 and bool(jnp.isfinite(aux["indexer_loss"]))
    assert bool(jnp.all(jnp.isfinite(logits)))
    # HF-style names at the top level.
    names = {str(p[0]) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert names == {"embed_tokens", "layers", "norm", "lm_head"}


@pytest.mark.parametrize("name", ["glm5.2", "deepseek-v3.2"])
def test_real_dimensions_abstract(name):
    """The full-size models, built abstractly (no memory): HF parameter shapes per layer."""
    c = get_config(name)
    model = nnx.eval_shape(lambda: DSALanguageModel(c, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    flat = {
        ".".join(str(getattr(k, "key", k)) for k in path): v
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    h, hid = c.num_attention_heads, c.hidden_size
    attn = "layers.3.self_attn."
    assert flat[attn + "kv_b_proj.weight"].shape == (h * (c.qk_nope_head_dim + c.v_head_dim), 512)
    qk_head_dim = 256 if name == "glm5.2" else 192
    assert flat[attn + "q_b_proj.weight"].shape == (h * qk_head_dim, c.q_lora_rank)
    assert flat[attn + "kv_a_proj_with_mqa.weight"].shape == (576, hid)
    assert flat[attn + "o_proj.weight"].shape == (hid, h * c.v_head_dim)
    wq_b = flat["layers.0.self_attn.indexer.wq_b.weight"]
    assert wq_b.shape == (c.index_n_heads * 128, c.q_lora_rank)
    assert flat["layers.0.self_attn.indexer.weights_proj.weight"].dtype == jnp.float32
    with_indexer = {int(k.split(".")[1]) for k in flat if ".indexer.wk." in k}
    assert with_indexer == set(c.full_indexer_layers)
    assert len(with_indexer) == (21 if name == "glm5.2" else 61)
    assert flat["embed_tokens.weight"].shape == (c.vocab_size, hid)


def test_indexshare_reuses_previous_full_layer():
    c = small_config("glm5.2", num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1)
    assert c.full_indexer_layers == (0, 2)
    model = DSALanguageModel(c, rngs=nnx.Rngs(1))
    randomize(model, 11)
    for i in range(4):
        assert (model.layers[i].self_attn.indexer is None) == (i in (1, 3))
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, c.vocab_size, jnp.int32)
    f = nnx.jit(lambda m, ids: m(ids, return_indices=True, compute_indexer_loss=False))
    _, aux = f(model, ids)
    idx = [np.asarray(i) for i in aux["indices"]]
    np.testing.assert_array_equal(idx[1], idx[0])
    np.testing.assert_array_equal(idx[3], idx[2])
    assert not np.array_equal(idx[2], idx[0])  # layer 2 runs its own indexer
    assert idx[0].shape == (2, 16, c.index_topk)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_packed_documents_equal_separate_runs(mode):
    c = small_config("deepseek-v3.2", num_hidden_layers=2)
    model = DSALanguageModel(c, rngs=nnx.Rngs(2))
    randomize(model, 12)
    la, lb = 7, 9
    a = jax.random.randint(jax.random.key(2), (1, la), 0, c.vocab_size, jnp.int32)
    b = jax.random.randint(jax.random.key(3), (1, lb), 0, c.vocab_size, jnp.int32)
    ids = jnp.concatenate([a, b], 1)
    pos = jnp.concatenate([jnp.arange(la), jnp.arange(lb)])[None].astype(jnp.int32)
    seg = jnp.array([[0] * la + [1] * lb], jnp.int32)

    @nnx.jit
    def run(m):  # one compile for the four runs
        kw = dict(attention_mode=mode, compute_indexer_loss=False)
        packed = m(ids, pos, seg, **kw)[0]
        leaky = m(ids, pos, **kw)[0]  # no segment ids: b sees a
        return packed, leaky, m(a, **kw)[0], m(b, **kw)[0]

    packed, leaky, alone_a, alone_b = run(model)
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(packed[:, :la]), np.asarray(alone_a), **tol)
    np.testing.assert_allclose(np.asarray(packed[:, la:]), np.asarray(alone_b), **tol)
    assert float(jnp.max(jnp.abs(leaky[:, la:] - alone_b))) > 1e-3


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_gradient_separation(mode):
    """The LM loss never reaches indexer parameters; the indexer loss reaches only them."""
    c = small_config("glm5", num_hidden_layers=1)
    model = DSALanguageModel(c, rngs=nnx.Rngs(3))
    randomize(model, 13)
    ids = jax.random.randint(jax.random.key(4), (2, 12), 0, c.vocab_size, jnp.int32)

    def losses(m):
        logits, aux = m(ids, attention_mode=mode)
        return lm_loss(logits, ids), aux["indexer_loss"]

    g_lm, g_ix = nnx.jit(
        lambda m: (nnx.grad(lambda m: losses(m)[0])(m), nnx.grad(lambda m: losses(m)[1])(m))
    )(model)
    n_ix = 0
    for (path, a), (_, b) in zip(nnx.to_flat_state(g_lm), nnx.to_flat_state(g_ix)):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        if is_indexer(path):
            n_ix += 1
            assert np.all(a == 0), path
            assert np.any(b != 0), path
        else:
            assert np.all(b == 0), path
            if "embed_tokens" not in [str(getattr(p, "key", p)) for p in path]:
                assert np.any(a != 0), path
    assert n_ix == 5  # wq_b, wk, k_norm.{weight,bias}, weights_proj


def _train(model, ids, loss_fn, steps, lr, wrt=nnx.Param):
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=wrt)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt)) for _ in range(steps)]


def test_training_reduces_lm_loss():
    c = small_config("glm5", num_hidden_layers=1)
    model = DSALanguageModel(c, rngs=nnx.Rngs(5))
    ids = jax.random.randint(jax.random.key(5), (4, 32), 0, c.vocab_size, jnp.int32)

    def loss_fn(m):
        logits, aux = m(ids)
        return lm_loss(logits, ids) + aux["indexer_loss"]

    hist = _train(model, ids, loss_fn, steps=12, lr=1e-2)
    assert hist[0] == pytest.approx(np.log(c.vocab_size), rel=0.05)  # ~uniform at init
    assert hist[-1] < hist[0] - 0.5, hist


def test_training_the_indexer_reduces_its_loss():
    """Dense warm-up: only the indexer trains, on the KL loss; it learns the attention."""
    c = small_config("deepseek-v3.2", num_hidden_layers=1)
    model = DSALanguageModel(c, rngs=nnx.Rngs(6))
    randomize(model, 16)
    ids = jax.random.randint(jax.random.key(6), (2, 24), 0, c.vocab_size, jnp.int32)
    indexer_params = nnx.All(nnx.Param, nnx.PathContains("indexer"))

    def loss_fn(m):
        return m(ids, attention_mode="dense")[1]["indexer_loss"]

    hist = _train(model, ids, loss_fn, steps=15, lr=3e-2, wrt=indexer_params)
    assert hist[-1] < 0.5 * hist[0], hist


def test_argument_errors():
    c = small_config("glm5")
    model = DSALanguageModel(c, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_ids"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="input_ids"):
        model(jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match="attention_mode"):
        model(jnp.zeros((1, 4), jnp.int32), attention_mode="topk")
    with pytest.raises(ValueError, match="positions"):
        model(jnp.zeros((1, 4), jnp.int32), positions=jnp.zeros((1, 5), jnp.int32))
