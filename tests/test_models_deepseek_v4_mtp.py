"""Tests for jax_dsa.models.deepseek_v4.mtp (DeepSeek V4's optional multi-token-prediction layers).
transformers builds no MTP, so these check properties: the main logits do not change, depth k at
position i sees tokens up to i + k only (with window-only attention in the MTP block), and the MTP
loss trains the MTP layers and the shared embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.config import CSA, SLIDING
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.models.deepseek_v4.mtp import shift_ids

B, S = 1, 24


@pytest.fixture(scope="module")
def models():
    c = get_config("deepseek-v4-tiny", hidden_size=32, num_attention_heads=2, head_dim=16,
                   q_lora_rank=16, qk_rope_head_dim=8, o_lora_rank=8, index_n_heads=4,
                   index_head_dim=16, index_topk=4, sliding_window=8, num_hidden_layers=2,
                   layer_types=(SLIDING, CSA), mlp_layer_types=("hash_moe", "moe"),
                   moe_intermediate_size=16, num_nextn_predict_layers=2)
    with_mtp = DeepseekV4LanguageModel(c, rngs=nnx.Rngs(3), mtp=True)
    plain = DeepseekV4LanguageModel(c, rngs=nnx.Rngs(3))
    return c, with_mtp, plain


def test_mtp_main_logits_causality_and_gradients(models):
    """One compiled value-and-grad of the depth-1 MTP loss, run on two id rows."""
    c, with_mtp, plain = models
    graphdef, params, rest = nnx.split(with_mtp, nnx.Param, ...)

    def loss(p, ids):
        logits, aux = nnx.merge(graphdef, p, rest)(ids, compute_indexer_loss=False)
        depth1 = aux["mtp_logits"][0][:, :-2]  # depth 1 at i predicts token i + 2
        return optax.softmax_cross_entropy_with_integer_labels(depth1, ids[:, 2:]).mean(), (
            logits, aux["mtp_logits"])

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, c.vocab_size, (B, S)), jnp.int32)
    (_, (logits, mtp)), g = step(params, ids)
    plain_logits, plain_aux = nnx.jit(lambda m, i: m(i, compute_indexer_loss=False))(plain, ids)
    np.testing.assert_array_equal(logits, plain_logits)  # same draws, same main model
    assert "mtp_logits" not in plain_aux
    assert len(mtp) == 2 and all(m.shape == (B, S, c.vocab_size) for m in mtp)
    j = 15  # change token j: depth k at position i reads tokens <= i + k
    ids2 = ids.at[:, j].set((ids[:, j] + 1) % c.vocab_size)
    (_, (_, mtp2)), _ = step(params, ids2)
    for k, (a, b) in enumerate(zip(mtp, mtp2), start=1):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(a[:, :j - k], b[:, :j - k])
        assert np.abs(a[:, j - k] - b[:, j - k]).max() > 0
    np.testing.assert_array_equal(shift_ids(ids, 2)[:, :-2], ids[:, 2:])
    assert (np.asarray(shift_ids(ids, 2)[:, -2:]) == 0).all()
    # the MTP loss trains the MTP layer, the shared embedding and the main layers below it
    assert np.abs(np.asarray(g["mtp"][0]["e_proj"]["weight"][...])).max() > 0
    assert np.abs(np.asarray(g["embed_tokens"]["weight"][...])).max() > 0
    assert np.abs(np.asarray(g["layers"][1]["mlp"]["experts"]["gate_proj"][...])).max() > 0
    assert np.abs(np.asarray(g["mtp"][1]["e_proj"]["weight"][...])).max() == 0  # depth 2
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        DeepseekV4LanguageModel(get_config("deepseek-v4-tiny"), rngs=nnx.Rngs(0), mtp=True)
