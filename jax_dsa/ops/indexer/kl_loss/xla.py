"""The ``"xla"`` implementation of ``indexer_kl_loss``: pure JAX, any platform, the oracle.

Queries are processed in blocks (``lax.map``) whose body is rematerialised (``jax.checkpoint``),
so neither pass holds more than one block's ``[block_q, H, S_kv]`` (dense) or ``[block_q, H, K]``
(sparse) temporaries. The backward is the VJP of the forward
(:func:`jax_dsa.ops.indexer.kl_loss.vjp.autodiff_backward`).
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


def forward(layout, iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, *rest, config: KLConfig):
    """Per batch element of this shard: ``(kl_sum [NB], row_count [NB])`` over its rows.
    ``rest``: ``(idx,)``, after ``attention_lse`` and ``index_scores`` when given (see
    :meth:`KLConfig.unpack`; the index scores are recomputed here, the given ones unused)."""
    acc = acc_dtype(iq, ik, iw, q, kv)
    scale = config.sm_scale
    lse, _, idx = config.unpack(rest)

    def one(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx, lse):
        row_ok = jnp.ones(iq.shape[:1], jnp.bool_)  # local rows when split over a mesh

        def block(xs):
            iqb, iwb, pb, sb, qb, ib, okb, lb = xs
            support, score, logits = block_support_and_logits(
                iqb, iwb, pb, sb, qb, ib, okb, ik, kv, kv_pos, kv_seg, scale, acc
            )
            log_pi = masked_log_softmax(score, support)
            if lb is None:
                log_p_h = masked_log_softmax(logits, support[:, None, :])
            else:  # the given denominators
                log_p_h = jnp.where(support[:, None, :], logits - lb.astype(acc)[..., None],
                                    -jnp.inf)
            # log of the head mean, without leaving log space (no underflow to log 0).
            # Heads split over a mesh: the head mean spans every head shard.
            log_p = head_logsumexp(log_p_h, 1, layout) - jnp.log(jnp.asarray(config.h, acc))
            if lb is not None:  # renormalised over the support (given lse: 1 up to rounding)
                log_p = masked_log_softmax(jnp.where(support, log_p, 0), support)
            p = jnp.where(support, jnp.exp(log_p), 0)
            kl = jnp.sum(jnp.where(support, p * (log_p - log_pi), 0), axis=-1)
            has = jnp.any(support, axis=-1)
            return jnp.sum(jnp.where(has, kl, 0)), jnp.sum(has.astype(jnp.int32))

        xs = blocks_of(config.block_q, iq, iw, q_pos, q_seg, q, idx, row_ok, lse)
        kl, count = jax.lax.map(jax.checkpoint(block), xs)
        return jnp.sum(kl), jnp.sum(count)

    return jax.vmap(one)(iq, ik, iw, q_pos, kv_pos, q_seg, kv_seg, q, kv, idx, lse)


def _forward(layout, *args):
    return forward(layout, *args[:-1], config=args[-1])


IMPLEMENTATION = Implementation("xla", determinism.xla_supported, _forward, autodiff_backward(_forward))
