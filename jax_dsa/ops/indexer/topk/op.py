"""``indexer_topk``: the lightning indexer's top-k key selection (the public op).

Index score (DeepSeek-V3.2 paper, arXiv:2512.02556, eq. 1; deepseek-ai/DeepSeek-V3.2-Exp
``inference/model.py``)::

    I[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])

Sharding contract (:func:`jax_dsa.sharding.partition.partitioned_call`) on flattened batches:
``q [NB, S_q, H_I, D_I]``, ``k [NB, S_kv, D_I]``, ``weights [NB, S_q, H_I]``, positions and
segment ids ``[NB, S_q]`` / ``[NB, S_kv]``. Queries stay local, keys are gathered along the
sequence; index heads are not split: every head shard computes the same top-k (Megatron-LM's
"duplicated" indexer), so the selection is identical on all of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.ops.indexer.topk import cuda as topk_cuda
from jax_dsa.ops.indexer.topk import xla as topk_xla
from jax_dsa.ops.blocks import acc_dtype, default_block_q, flatten_batch
from jax_dsa.ops.checks import check_int, check_positions
from jax_dsa.ops.indexer.scores import check_indexer, quantize_fp8
from jax_dsa.ops.indexer.topk.config import TopkCall, TopkConfig
from jax_dsa.ops.registry import Registry
from jax_dsa.sharding.partition import Result, partitioned_call

REGISTRY = Registry("indexer_topk", (topk_xla.IMPLEMENTATION, topk_cuda.IMPLEMENTATION),
                    preference={"gpu": ("cuda", "xla"), "default": ("xla",)})

ROLES = ("bs..", "bt.", "bs.", "bs", "bt", "bs", "bt")  # shared with the KL losses' operands
RESULTS = (Result("bs."), Result("bs."))  # [NB, S_q, topk] global key indices, their scores


def indexer_topk(
    q,
    k,
    weights,
    *,
    topk,
    q_positions,
    kv_positions,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_q=None,
    qk_dtype=None,
    return_scores=False,
    implementation=None,
):
    """The ``topk`` visible keys of each query by lightning-indexer score.

    ``I[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])`` in float32 (float64 for float64
    inputs), over the keys visible to ``t`` (see :func:`~jax_dsa.ops.visibility.visible_mask`). Keys come out by
    descending score; equal scores (common: ReLU makes plateaus of exact zeros) are ordered by
    ascending key index, so the result is deterministic. A row with fewer than ``topk`` visible
    keys is padded with ``-1`` at the end; invisible keys are never chosen, whatever the scores.
    The result is ready for :func:`jax_dsa.sparse_mla` (``-1`` marks an invalid slot) and carries
    no gradient.

    Source: DeepSeek-V3.2 paper eq. (1) and deepseek-ai/DeepSeek-V3.2-Exp ``inference/model.py``
    (``Indexer``): scores of masked keys set to ``-inf`` before top-k.

    Args:
      q: ``[..., S_q, index_n_heads, index_head_dim]`` float indexer queries.
      k: ``[..., S_kv, index_head_dim]`` float indexer keys (one per token, shared by the heads).
      weights: ``[..., S_q, index_n_heads]`` float per-query head weights (scale folded in).
      topk: number of keys per query (Python int >= 1); may exceed ``S_kv``.
      q_positions, kv_positions: ``[..., S_q]`` / ``[..., S_kv]`` integer token positions.
      q_segment_ids, kv_segment_ids: optional ``[..., S_q]`` / ``[..., S_kv]`` integer document
        ids (both or neither).
      block_q: query rows per block of the ``"xla"`` implementation (Python int >= 1); ``None``
        picks the largest power of two <= 128 whose ``[block_q, index_n_heads, S_kv]`` scores
        fit :data:`~jax_dsa.ops.blocks.BLOCK_ELEMENTS`.
      qk_dtype: ``None`` (scores from ``q`` and ``k`` as given) or ``"float8_e4m3fn"`` (also
        ``jnp.float8_e4m3fn``): DeepSeek-V3.2's FP8 indexer. ``q`` is quantized per (token,
        head) and ``k`` per token by :func:`~jax_dsa.ops.indexer.scores.quantize_fp8`
        (power-of-two scales); ``q``'s scales are folded into ``weights`` and each key's
        score is multiplied by its scale, so ``I[t, s] = k_scale[s] * sum_h (weights[t, h] *
        q_scale[t, h]) * relu(q_fp8[t, h] . k_fp8[s])``. Both implementations form the fp8
        products exactly (``"cuda"`` on its bf16 kernel, where an e4m3 value times a
        power-of-two scale is exact; ``"xla"`` in float32), so the option changes which keys
        are selected (as DeepSeek-V3.2's and prime-rl's inference select them), not the speed.
      return_scores: also return each selected key's score as the implementation computed it,
        e.g. for :func:`~jax_dsa.ops.indexer.kl_loss.indexer_kl_loss`'s ``index_scores``.
      implementation: a name of :data:`REGISTRY`, a sequence of names (the first that supports
        the call runs), or ``None`` (on a GPU ``("cuda", "xla")``, else ``"xla"``). ``"xla"``:
        pure JAX, any platform. ``"cuda"``: SM90 kernels (:mod:`~jax_dsa.ops.indexer.topk.cuda`;
        q and k rounded to bfloat16 unless ``qk_dtype`` is fp8, index_head_dim 128,
        index_n_heads <= 64, topk <= 2048).

    Returns:
      ``[..., S_q, topk]`` int32 key indices into the same batch element's ``k``, ``-1`` padded;
      with ``return_scores``, ``(indices, scores)`` where ``scores [..., S_q, topk]`` float32
      (float64 for float64 inputs on ``"xla"``) holds ``I[t, indices[t, j]]`` and ``-inf`` on
      ``-1`` slots (visible scores are clamped to the lowest finite float, ``-0.0`` to ``+0.0``).

    Raises:
      ValueError: wrong ranks or shapes (named by argument), ``S_kv == 0``, ``topk < 1``,
        ``block_q < 1``, only one of the segment ids given, ``qk_dtype`` not ``None`` or
        float8_e4m3fn, an unknown implementation or one that does not support the call.
      NotImplementedError: the requested implementations are not built in this install.
      TypeError: non-integer ``topk``/``block_q``/positions/segment ids, non-float ``q``, ``k``
        or ``weights``.
    """
    name = "indexer_topk"
    REGISTRY.candidates(implementation)  # an unknown name fails before the shape checks
    q, k, weights = (jnp.asarray(x) for x in (q, k, weights))
    batch, s_q, h_i, s_kv = check_indexer(name, q, k, weights)
    q_pos, kv_pos, q_seg, kv_seg = check_positions(
        name, q_positions, kv_positions, q_segment_ids, kv_segment_ids, batch + (s_q,),
        batch + (s_kv,),
    )
    topk = check_int(name, "topk", topk)
    if block_q is None:
        block_q = default_block_q(s_q, h_i * s_kv)
    else:
        block_q = check_int(name, "block_q", block_q)
    fp8 = check_qk_dtype(name, qk_dtype)
    k_eff = min(topk, s_kv)  # selected keys; the rest is -1 padding
    impl = REGISTRY.choose(implementation, TopkCall(
        jnp.dtype(acc_dtype(q, k, weights)), h_i, q.shape[-1], s_q, s_kv, k_eff,
        q_seg is not None, fp8))

    return_scores = bool(return_scores)
    if s_q == 0:  # no query, nothing to select: no kernel launch (an empty grid is invalid)
        empty = (jnp.zeros(batch + (0, topk), jnp.int32),
                 jnp.zeros(batch + (0, topk), acc_dtype(q, k, weights)))
        return empty if return_scores else empty[0]
    q, k, weights = (jax.lax.stop_gradient(x) for x in (q, k, weights))
    k_scale = None
    if fp8:
        q, q_scale = quantize_fp8(q)
        k, k_scale = quantize_fp8(k)
        weights = weights.astype(jnp.promote_types(weights.dtype, jnp.float32)) * q_scale
    args = flatten_batch(batch, q, k, weights, q_pos, kv_pos, q_seg, kv_seg)
    args += (None if k_scale is None else k_scale.reshape(args[4].shape),)
    config = TopkConfig(k_eff, block_q, impl, return_scores)
    outs = partitioned_call("indexer_topk", lambda layout, *a: impl.forward(*a, config), args,
                            ROLES + ("bt",), RESULTS[:1 + return_scores])  # + k_scale
    pad = ((0, 0), (0, 0), (0, topk - k_eff))
    fills = (-1, -jnp.inf)
    outs = tuple(jnp.pad(x, pad, constant_values=f).reshape(batch + (s_q, topk))
                 for x, f in zip(outs, fills))
    return outs if return_scores else outs[0]


def check_qk_dtype(name, qk_dtype) -> bool:
    """Whether ``qk_dtype`` asks for the fp8 scores (``None``: no); raises for other values."""
    if qk_dtype is None:
        return False
    try:
        dtype = jnp.dtype(qk_dtype)
    except TypeError:
        dtype = None
    if dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{name}: qk_dtype must be None or 'float8_e4m3fn', got {qk_dtype!r}")
    return True
