"""``indexer_kl_loss``: the lightning indexer's training loss (the public op).

DeepSeek-V3.2 paper (arXiv:2512.02556) §2.1: the KL divergence from the main attention's
head-mean distribution to the indexer's softmax, dense (warm-up) or over the selected slots.
Its custom VJP and sharding contract: :mod:`jax_dsa.ops.indexer.kl_loss.vjp`.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.indexer.kl_loss import xla as kl_loss_xla
from jax_dsa.ops.blocks import acc_dtype
from jax_dsa.ops.indexer.kl_loss.common import check_kl_args
from jax_dsa.ops.indexer.kl_loss.config import KLConfig
from jax_dsa.ops.indexer.kl_loss.vjp import (
    ROLES,
    V4_ROLES,
    describe,
    flat_operands,
    kl_call,
    mean_of_rows,
)
from jax_dsa.ops import determinism
from jax_dsa.ops.registry import Registry

# On a GPU both forms run on "cuda" where its limits allow, else on "xla".
REGISTRY = Registry("indexer_kl_loss", (kl_loss_xla.IMPLEMENTATION, kl_loss_cuda.IMPLEMENTATION),
                    preference={"gpu": ("cuda", "xla"), "default": ("xla",)})


def indexer_kl_loss(
    index_q,
    index_k,
    index_weights,
    q,
    kv,
    *,
    sm_scale,
    q_positions,
    kv_positions,
    q_segment_ids=None,
    kv_segment_ids=None,
    indices=None,
    attention_lse=None,
    index_scores=None,
    block_q=None,
    implementation=None,
    deterministic=None,
):
    """The indexer's training loss: KL from the main attention's head-mean distribution.

    DeepSeek-V3.2 paper §2.1. For each query row ``t`` with a non-empty support ``S_t``::

        p[t, s]  = mean_h softmax_{s in S_t}(sm_scale * q[t, h] . kv[s])     (target)
        pI[t, s] = softmax_{s in S_t}(I[t, s])                               (indexer)
        KL_t     = sum_{s in S_t} p[t, s] * (log p[t, s] - log pI[t, s])     (natural log)

    with ``I`` the index score of :func:`~jax_dsa.ops.indexer.topk.indexer_topk`. The loss is the mean of ``KL_t`` over
    all rows (of all batch elements) whose support is non-empty; it is 0 when no row has one.
    Terms with ``p = 0`` count as 0.

    * Dense form (``indices=None``, the warm-up stage): ``S_t`` = every key visible to ``t``
      (see :func:`~jax_dsa.ops.visibility.visible_mask`).
    * Sparse form (``indices [..., S_q, K]``): ``S_t`` = the row's slots ``j`` with
      ``0 <= indices[t, j] < S_kv`` (``-1`` and out-of-range mark an invalid slot, as in
      :func:`jax_dsa.sparse_mla`) whose key is visible to ``t``; duplicate indices count as
      separate slots. Target and indexer softmax are both renormalised over ``S_t``. For
      indices from :func:`indexer_topk` with the same positions every valid slot is visible, and
      ``p`` is the head mean of ``sparse_mla``'s attention probabilities (no sink).

    Gradients flow to ``index_q``, ``index_k`` and ``index_weights`` only. ``q`` and ``kv`` are
    wrapped in ``stop_gradient`` (the paper's detached target: the indexer learns only from this
    loss; give the LM loss the indexer's output only through ``indexer_topk``, which carries no
    gradient). The per-block body is rematerialised, so the backward pass needs no
    ``[S_q, S_kv]`` residuals.

    Args:
      index_q: ``[..., S_q, index_n_heads, index_head_dim]`` float indexer queries.
      index_k: ``[..., S_kv, index_head_dim]`` float indexer keys.
      index_weights: ``[..., S_q, index_n_heads]`` float head weights (scale folded in).
      q: ``[..., S_q, H, D_qk]`` float main-attention queries (absorbed MLA form, as fed to
        ``sparse_mla``).
      kv: ``[..., S_kv, D_qk]`` float latent key rows, q's dtype.
      sm_scale: the main attention's softmax scale (Python number), as given to ``sparse_mla``.
      q_positions, kv_positions: ``[..., S_q]`` / ``[..., S_kv]`` integer token positions.
      q_segment_ids, kv_segment_ids: optional ``[..., S_q]`` / ``[..., S_kv]`` integer document
        ids (both or neither).
      indices: optional ``[..., S_q, K]`` integer key rows per query (the sparse form).
      attention_lse: optional ``[..., S_q, H]`` float natural-log softmax denominators of the
        main attention over the same support (the ``lse`` that :func:`jax_dsa.sparse_mla`
        returns for these ``indices``, or ``dense_mla``'s in the dense form). Given, the target
        is ``mean_h exp(sm_scale * q . kv - attention_lse)`` renormalised over ``S_t`` (equal to
        the above up to rounding) and is not recomputed from a softmax: ``"cuda"`` then takes
        it from the attention kernel's target mode (one pass of ``Q K^T``, no ``P V``). In the
        dense form ``"cuda"``'s gradients take the head mean as normalised (each head's
        denominator over exactly the visible keys, as ``dense_mla`` without ``attn_sink``).
      index_scores: optional ``[..., S_q, K]`` float index scores ``I`` of the ``indices``
        slots, as :func:`~jax_dsa.ops.indexer.topk.indexer_topk` returns them with
        ``return_scores=True`` for the same ``index_q``, ``index_k``, ``index_weights`` and
        positions, and without ``qk_dtype`` (fp8 scores are not this loss's scores). The
        sparse form only; a value the loss may use in place of recomputing the scores
        (``"cuda"`` with ``attention_lse``: no score kernel in either pass; ``"xla"`` ignores
        it) and carries no gradient: the gradients are those of the recomputed scores. Scores
        that do not match the inputs give a wrong loss where they are used.
      block_q: query rows per block of the ``"xla"`` implementation (Python int >= 1); ``None``
        picks one from ``S_kv`` (dense) or ``K`` (sparse) so that a block's temporaries fit
        :data:`~jax_dsa.ops.blocks.BLOCK_ELEMENTS`.
      implementation: a name of :data:`REGISTRY`, a sequence of names (the first that supports
        the call runs), or ``None`` (on a GPU ``("cuda", "xla")``, else ``"xla"``). ``"xla"``:
        pure JAX, any platform. ``"cuda"``: SM90 kernels
        (:mod:`~jax_dsa.ops.indexer.kl_loss.cuda`; the main and index tensors rounded to
        bfloat16, D_qk 512 or 576, index_head_dim 128, H <= 128, K <= 2048; the dense form in
        chunks of 2048 keys, never an ``[S_q, S_kv]`` buffer, fastest with ``attention_lse``).
      deterministic: ``True``: gradients bitwise identical from run to run (``"cuda"`` sums
        ``d index_k`` in 64-bit fixed point instead of float32 atomics; ``"xla"`` on a GPU
        only under XLA's ``--xla_gpu_deterministic_ops=true``); ``False``: the fastest order;
        ``None`` (default): that XLA flag decides (:mod:`jax_dsa.ops.determinism`).

    Returns:
      A scalar: float32, or float64 when an input is float64 (under x64).

    Raises:
      ValueError: ``sm_scale`` not finite and positive, wrong ranks or shapes (named by
        argument), ``S_kv == 0``, ``block_q < 1``, ``index_scores`` without ``indices``,
        only one of the segment ids given, an unknown implementation or one that does not
        support the call.
      NotImplementedError: the requested implementations are not built in this install.
      TypeError: ``sm_scale`` not a number; ``deterministic`` not None or a bool; non-float
        tensors (``index_scores`` included), ``q``/``kv`` dtypes that differ;
        non-integer ``indices``, positions, segment ids or ``block_q``.
    """
    name = "indexer_kl_loss"
    REGISTRY.candidates(implementation)  # an unknown name fails before the shape checks
    deterministic = determinism.resolve(name, deterministic)
    index_q, index_k, index_weights, q, kv = (
        jnp.asarray(x) for x in (index_q, index_k, index_weights, q, kv)
    )
    batch, s_q, h_i, s_kv, h, indices, block_q, (q_pos, kv_pos, q_seg, kv_seg) = check_kl_args(
        name, index_q, index_k, index_weights, q, kv, sm_scale, indices, block_q, q_positions,
        kv_positions, q_segment_ids, kv_segment_ids)
    per_head = ()
    if attention_lse is not None:
        attention_lse = jnp.asarray(attention_lse)
        if attention_lse.shape != batch + (s_q, h):
            raise ValueError(f"{name}: attention_lse must be [..., S_q, H] = {batch + (s_q, h)}, "
                             f"got {attention_lse.shape}")
        if not jnp.issubdtype(attention_lse.dtype, jnp.floating):
            raise TypeError(f"{name}: attention_lse must be a float array, got "
                            f"{attention_lse.dtype}")
    per_slot = ()
    if index_scores is not None:
        index_scores = jnp.asarray(index_scores)
        if indices is None:
            raise ValueError(f"{name}: index_scores are the scores of `indices`: give both, or "
                             "neither for the dense form")
        if index_scores.shape != indices.shape:
            raise ValueError(f"{name}: index_scores must be [..., S_q, K] = {indices.shape} like "
                             f"indices, got {index_scores.shape}")
        if not jnp.issubdtype(index_scores.dtype, jnp.floating):
            raise TypeError(f"{name}: index_scores must be a float array, got "
                            f"{index_scores.dtype}")
        per_slot = (index_scores,)
    acc = acc_dtype(index_q, index_k, index_weights, q, kv)
    if attention_lse is not None:
        per_head = (attention_lse.astype(jnp.promote_types(acc, jnp.float32)),)
    impl = REGISTRY.choose(implementation, describe(acc, index_q, q, s_kv, indices,
                                                    q_seg is not None, bool(per_head),
                                                    deterministic))
    operands = flat_operands(batch, index_q, index_k, index_weights,
                             (q_pos, kv_pos, q_seg, kv_seg), q, kv, per_head, indices, per_slot)
    config = KLConfig(float(sm_scale), h, block_q, impl, given_lse=bool(per_head),
                      given_scores=bool(per_slot), deterministic=deterministic)
    roles = (V4_ROLES if per_head else ROLES)[:-1] + ("bs.",) * len(per_slot) + ("bs.",)
    kl, count = kl_call(name, config, roles, *operands)
    return mean_of_rows(kl, count, acc)
