"""Tests for jax_dsa.models.deepseek_v4.model: the small DeepSeek V4 LM runs every layer type, and
on real text its LM loss falls while the CSA indexers learn from their KL loss alone."""

from __future__ import annotations

import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.models.deepseek_v4.slots import slot_width


def _text_batch(b, s):
    """Bytes of a standard-library source file: real text, no download."""
    data = np.frombuffer(inspect.getsource(json.decoder).encode(), np.uint8)
    rows = [data[i * (s + 1): (i + 1) * (s + 1)] for i in range(b)]
    arr = jnp.asarray(np.stack(rows).astype(np.int32))
    return arr[:, :-1], arr[:, 1:]


def test_forward_shapes_and_slot_lists():
    c = get_config("deepseek-v4-tiny")
    model = DeepseekV4LanguageModel(c, rngs=nnx.Rngs(0))
    ids, _ = _text_batch(2, 96)
    logits, aux = nnx.jit(lambda m, ids: m(ids, return_indices=True))(model, ids)
    assert logits.shape == (2, 96, 256) and logits.dtype == jnp.float32
    assert np.isfinite(float(aux["indexer_loss"])) and float(aux["indexer_loss"]) > 0
    for t, idx, n in zip(c.layer_types, aux["indices"], aux["topk_length"]):
        assert idx.shape == (2, 96, slot_width(c, t, 96))
        assert (np.asarray(n) >= 1).all()
    with pytest.raises(ValueError, match="attention_mode"):
        model(ids, attention_mode="warmup")
    with pytest.raises(TypeError, match="integer"):
        model(ids.astype(jnp.float32))


@pytest.mark.slow
def test_trains_on_text_and_indexer_learns():
    """Indexer alone (the paper's warm-up: everything else frozen, so the KL teacher is fixed):
    its loss falls. Then everything: the LM loss falls. One compiled step; the update mask is an
    argument."""
    c = get_config("deepseek-v4-tiny")
    model = DeepseekV4LanguageModel(c, rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ids, targets = _text_batch(2, 96)
    tx = optax.adam(3e-3)

    def losses(p):
        logits, aux = nnx.merge(graphdef, p, rest)(ids)
        lm = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return lm + aux["indexer_loss"], (lm, aux["indexer_loss"])

    @jax.jit
    def step(p, opt, mask):
        (_, (lm, il)), g = jax.value_and_grad(losses, has_aux=True)(p)
        upd, opt = tx.update(g, opt, p)
        upd = jax.tree.map(lambda u, m: u * m, upd, mask)
        return optax.apply_updates(p, upd), opt, lm, il

    def mask_of(keep):
        flat = nnx.to_flat_state(params)
        return nnx.from_flat_state(
            [(path, v.replace(jnp.float32(keep(path)))) for path, v in flat]
        )

    only_indexer = mask_of(lambda path: "indexer" in path)
    everything = mask_of(lambda path: True)
    opt = tx.init(params)
    hist = []
    for mask in [only_indexer] * 8 + [everything] * 8:
        params, opt, lm, il = step(params, opt, mask)
        hist.append((float(lm), float(il)))
    lm, il = np.array(hist).T
    print("lm", np.round(lm, 3), "indexer", np.round(il, 4))
    assert il[7] < 0.5 * il[0]  # the indexer learns from its KL loss
    assert lm[7] == pytest.approx(lm[0], rel=0.02)  # frozen LM (only the top-k choice moved)
    assert lm[-1] < 0.85 * lm[8]
