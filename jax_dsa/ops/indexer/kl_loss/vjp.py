"""The custom VJP and sharding contract shared by the indexer KL losses.

Operands on flattened batches, as :data:`jax_dsa.ops.indexer.topk.ROLES` (index tensors,
positions, segment ids) followed by the main attention's ``q [NB, S_q, H, D_qk]`` (split by head
under tensor parallelism), ``kv [NB, S_kv, D_qk]`` (gathered along the sequence), for DeepSeek V4
the log denominator ``attention_lse [NB, S_q, H]``, and the optional slots ``[NB, S_q, K]``.
An implementation computes, per shard, each batch element's KL sum and row count (partial sums
over the local rows, reduced here), and in its backward the gradients for ``index_q``,
``index_k`` (a partial sum over the local rows, reduce-scattered along the sequence) and
``index_weights``. ``q``, ``kv`` and ``attention_lse`` take no gradient (the detached target).

A forward may also return per-row residuals ``[NB, S_q, R]`` float32 (e.g. DeepSeek V4's dense
form's softmax statistics, so that its backward needs one pass over the keys instead of two);
they reach its backward as ``residuals=``. A forward that returns two results saves none.

In the dense form (no slots) an implementation with ``forward_with_grads`` computes the
gradients in its forward instead (``(kl_sum, row_count, (d index_q, d index_k,
d index_weights))`` for a unit cotangent of each batch element's KL sum): its backward pass
would repeat the forward's passes over every key. The gradients are saved in the index tensors'
dtypes and scaled by the cotangent in the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsa.ops.blocks import acc_dtype, flatten_batch
from jax_dsa.ops.indexer.kl_loss.config import KLCall
from jax_dsa.ops.indexer.topk.op import ROLES as TOPK_ROLES
from jax_dsa.sharding.partition import Result, partitioned_call, typed_like

ROLES = TOPK_ROLES + ("bsh.", "bt.", "bs.")
V4_ROLES = ROLES[:-1] + ("bsh", "bs.")  # + attention_lse before the slots
# per batch element: KL sum, row count; per row: the forward's residuals for the backward
RESULTS = (Result("b", "s"), Result("b", "s"), Result("bs."))
GRAD_RESULTS = (Result("bs.."), Result("bT."), Result("bs."))  # d index_q, index_k, weights


def kl_call(name, config, roles, *args):
    """``config.implementation``'s ``(kl_sum [NB], row_count [NB])``, split over the mesh in
    context and differentiable in the first three operands (the index tensors)."""
    return _kl(name, config, roles, *args)


def _forward(name, config, roles, args):
    impl = config.implementation

    def local(layout, *a):
        out = tuple(impl.forward(layout, *a, config))
        if len(out) == 2:  # no residuals
            out += (jnp.zeros(a[0].shape[:2] + (0,), jnp.float32),)
        return out

    return partitioned_call(name, local, args, roles, RESULTS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _kl(name, config, roles, *args):
    return _forward(name, config, roles, args)[:2]


def _kl_fwd(name, config, roles, *args):
    impl = config.implementation
    if args[-1] is None and impl.forward_with_grads is not None:  # the dense form
        def local(layout, *a):
            kl, count, grads = impl.forward_with_grads(layout, *a, config)
            return (kl, count) + tuple(grads)

        kl, count, *grads = partitioned_call(name, local, args, roles, RESULTS[:2] + GRAD_RESULTS)
        grads = tuple(typed_like(g.astype(x.dtype), x) for g, x in zip(grads, args))
        return (kl, count), (args, grads)
    kl, count, residuals = _forward(name, config, roles, args)
    return (kl, count), (args, residuals)


def _kl_bwd(name, config, roles, saved, cotangents):
    impl = config.implementation
    args, residuals = saved
    if isinstance(residuals, tuple):  # gradients from forward_with_grads, per batch element
        g = cotangents[0]
        grads = tuple(typed_like(d * g.reshape(g.shape + (1,) * (d.ndim - 1)).astype(d.dtype), x)
                      for d, x in zip(residuals, args))
        return grads + (None,) * (len(args) - 3)
    if residuals.shape[-1]:
        local = lambda layout, g, r, *a: impl.backward(layout, g, *a, config, residuals=r)
        operands, grad_roles = (cotangents[0], residuals) + args, ("b", "bs.") + roles
    else:
        local = lambda layout, g, *a: impl.backward(layout, g, *a, config)
        operands, grad_roles = (cotangents[0],) + args, ("b",) + roles
    grads = partitioned_call(f"{name} backward", local, operands, grad_roles, GRAD_RESULTS)
    # Reduced in the implementation's accumulation dtype, cast once to the primal's.
    grads = tuple(typed_like(g.astype(x.dtype), x) for g, x in zip(grads, args))
    return grads + (None,) * (len(args) - 3)


_kl.defvjp(_kl_fwd, _kl_bwd)


def autodiff_backward(forward):
    """A backward for a pure-JAX ``forward(layout, index_q, index_k, index_weights, *rest,
    config)``: its VJP in the index tensors, with ``index_k`` taken in the accumulation dtype so
    that the sum of its gradient over slots and query blocks never rounds to 16 bits."""

    def backward(layout, g, iq, ik, iw, *rest):  # rest: the other operands, then the config
        acc = acc_dtype(iq, ik, iw)

        def kl_sum(iq, ik, iw):
            return forward(layout, iq, ik, iw, *rest)[0]

        _, vjp = jax.vjp(kl_sum, iq, ik.astype(acc), iw)
        return vjp(g.astype(acc))

    return backward


def mean_of_rows(kl, count, acc):
    """The loss: the KL sum over every batch element divided by the rows with a support."""
    kl, count = jnp.sum(kl), jnp.sum(count)
    return jnp.where(count > 0, kl / jnp.maximum(count, 1).astype(acc), jnp.zeros((), acc))


def describe(acc, index_q, q, s_kv, indices, segments: bool, given_lse: bool = False,
             deterministic: bool = False) -> KLCall:
    """The :class:`KLCall` that implementations' ``supported`` checks see."""
    s_q, h_i, d_i = index_q.shape[-3:]
    h, d_qk = q.shape[-2:]
    topk = None if indices is None else indices.shape[-1]
    return KLCall(jnp.dtype(acc), h_i, d_i, h, d_qk, s_q, s_kv, topk, segments, given_lse,
                  deterministic)


def flat_operands(batch, index_q, index_k, index_weights, visibility, q, kv, per_head, indices,
                  per_slot=()):
    """The operands of :func:`kl_call` on one flattened batch dim, in :data:`ROLES` order, with
    ``per_head`` (``[..., S_q, H]`` arrays, e.g. V4's ``attention_lse``) and then ``per_slot``
    (``[..., S_q, K]``, e.g. ``index_scores``; role ``"bs."``) before the slots; the main
    attention's tensors and those arrays are detached."""
    nb = 1
    for n in batch:
        nb *= n
    flat = flatten_batch(batch, index_q, index_k, index_weights, *visibility)
    q = jax.lax.stop_gradient(q)
    s_q, h, d_qk = q.shape[-3:]
    main = (q.reshape((nb, s_q, h, d_qk)),
            jax.lax.stop_gradient(kv).reshape((nb, kv.shape[-2], d_qk)))
    per_head = tuple(jax.lax.stop_gradient(x).reshape((nb, s_q, h)) for x in per_head)
    per_slot = tuple(jax.lax.stop_gradient(x).reshape((nb, s_q, x.shape[-1])) for x in per_slot)
    idx = (None if indices is None  # (an explicit K: -1 cannot be inferred when S_q is 0)
           else indices.astype(jnp.int32).reshape((nb, s_q, indices.shape[-1])))
    return flat + main + per_head + per_slot + (idx,)
