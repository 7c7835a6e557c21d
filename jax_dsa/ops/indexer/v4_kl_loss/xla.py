"""The ``"xla"`` implementation of DeepSeek V4's indexer KL loss: pure JAX, any platform.

Query blocks with a rematerialised body, as :mod:`jax_dsa.ops.indexer.kl_loss.xla`; the
backward is the VJP of the forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.blocks import acc_dtype, blocks_of
from jax_dsa.ops.indexer.kl_loss.common import block_support_and_logits
from jax_dsa.ops.visibility import masked_log_softmax
from jax_dsa.ops.indexer.kl_loss.config import KLConfig
from jax_dsa.ops.indexer.kl_loss.vjp import autodiff_backward
from jax_dsa.ops import determinism
from jax_dsa.ops.registry import Implementation
from jax_dsa.sharding.partition import head_logsumexp


def forward(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx,
            config: KLConfig):
    """Per batch element of this shard: ``(kl_sum [NB], row_count [NB])`` over its rows."""
    acc = acc_dtype(iq, ik, iw, q, kv)
    scale = config.sm_scale

    def one(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx):
        row_ok = jnp.ones((iq.shape[0],), jnp.bool_)

        def block(xs):
            iqb, iwb, pb, sb, qb, lb, ib, okb = xs
            support, score, logits = block_support_and_logits(
                iqb, iwb, pb, sb, qb, ib, okb, ik, kv, kv_pos, kv_seg, scale, acc
            )
            log_pi = masked_log_softmax(score, support)
            # Per-head probabilities under the full denominator, summed over heads in log space.
            log_ph = jnp.where(support[:, None, :], logits - lb[:, :, None], -jnp.inf)
            log_t = head_logsumexp(log_ph, 1, layout)  # over every head shard
            log_p = masked_log_softmax(jnp.where(support, log_t, 0), support)
            p = jnp.where(support, jnp.exp(log_p), 0)
            # p = 0 terms are 0 (also where log p is -inf: a row whose lse is +inf).
            kl = jnp.sum(jnp.where(support & (p > 0), p * (log_p - log_pi), 0), axis=-1)
            has = jnp.any(support, axis=-1)
            return jnp.sum(jnp.where(has, kl, 0)), jnp.sum(has.astype(jnp.int32))

        xs = blocks_of(config.block_q, iq, iw, q_pos, q_seg, q, lse, idx, row_ok)
        kl, count = jax.lax.map(jax.checkpoint(block), xs)
        return jnp.sum(kl), jnp.sum(count)

    return jax.vmap(one)(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, lse, idx)


IMPLEMENTATION = Implementation("xla", determinism.xla_supported, forward, autodiff_backward(forward))
