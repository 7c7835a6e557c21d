"""DeepSeek V4's CSA indexer loss: KL from a teacher whose softmax includes the window and sink.

In a V4 CSA layer each query attends, in one softmax, to its sliding window of raw rows, to some
compressed entries and to a per-head sink. The indexer only chooses among the compressed
entries, so its teacher is the attention mass that lands on them, with the window and sink mass
left in the denominator (NVIDIA/Megatron-LM ``dev``: ``csa.py``,
``_compute_indexer_teacher_probabilities`` with ``non_compressed_lse``). For query ``t`` with compressed support ``S_t``::

    P_h[t, s] = exp(sm_scale * q[t, h] . kv[s] - attention_lse[t, h])      s in S_t
    p[t, s]   = sum_h P_h[t, s] / sum_{s' in S_t} sum_h P_h[t, s']          (target)
    pI[t, s]  = softmax_{s in S_t}(I[t, s])                                  (indexer)
    KL_t      = sum_{s in S_t} p[t, s] * (log p[t, s] - log pI[t, s])

where ``attention_lse[t, h]`` is the log of the main attention's whole softmax denominator
(window rows, the compressed slots it attended, and ``exp(attn_sink[h])``). A head that puts its
mass on the window or the sink therefore weighs less in the target than one that attends to the
compressed entries; with ``attention_lse`` equal to the per-head log-sum-exp over ``S_t`` alone the
target is the head mean of V3.2's :func:`~jax_dsa.ops.indexer.kl_loss.indexer_kl_loss`. Everything runs in
log space, so a compressed mass that underflows float32 does not zero the target.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.ops.indexer.v4_kl_loss import cuda as v4_kl_loss_cuda
from jax_dsa.ops.indexer.v4_kl_loss import xla as v4_kl_loss_xla
from jax_dsa.ops.blocks import acc_dtype
from jax_dsa.ops.indexer.kl_loss.common import check_kl_args
from jax_dsa.ops.indexer.kl_loss.config import KLConfig
from jax_dsa.ops.indexer.kl_loss.vjp import V4_ROLES, describe, flat_operands, kl_call, mean_of_rows
from jax_dsa.ops import determinism
from jax_dsa.ops.registry import Registry

# On a GPU both forms run on "cuda" where its limits allow, else on "xla".
REGISTRY = Registry("v4_indexer_kl_loss",
                    (v4_kl_loss_xla.IMPLEMENTATION, v4_kl_loss_cuda.IMPLEMENTATION),
                    preference={"gpu": ("cuda", "xla"), "default": ("xla",)})


def v4_indexer_kl_loss(
    index_q,
    index_k,
    index_weights,
    q,
    kv,
    attention_lse,
    *,
    sm_scale,
    q_positions,
    kv_positions,
    q_segment_ids=None,
    kv_segment_ids=None,
    indices=None,
    block_q=None,
    implementation=None,
    deterministic=None,
):
    """Mean over query rows of the KL from the window-and-sink-aware teacher to the indexer.

    The support ``S_t`` is, as in :func:`~jax_dsa.ops.indexer.kl_loss.indexer_kl_loss`: every compressed
    entry visible to ``t`` (dense form, ``indices=None``; visibility is
    ``kv_positions[s] <= q_positions[t]`` within the same segment), or the valid visible slots of
    ``indices[t]`` (sparse form: ``0 <= index < S_kv``; ``-1`` marks an invalid slot). Rows with an
    empty support are left out of the mean; the loss is 0 when no row has one.

    ``attention_lse`` must be the log of the softmax denominator of the attention whose heads
    define the teacher: the window, every compressed slot that attention used (a superset of
    ``S_t``) and the sink. From :func:`jax_dsa.sparse_mla`'s outputs:
    ``jnp.logaddexp(lse, attn_sink)``.

    Gradients flow to ``index_q``, ``index_k`` and ``index_weights`` only: ``q``, ``kv`` and
    ``attention_lse`` are wrapped in ``stop_gradient`` (the indexer learns only from this loss).
    Each query block's body is rematerialised in the backward pass.

    Args:
      index_q: ``[..., S_q, index_n_heads, index_head_dim]`` float indexer queries.
      index_k: ``[..., S_kv, index_head_dim]`` float indexer keys of the compressed entries.
      index_weights: ``[..., S_q, index_n_heads]`` float head weights (scale folded in).
      q: ``[..., S_q, H, D]`` float main-attention queries, as given to ``sparse_mla``.
      kv: ``[..., S_kv, D]`` float compressed K = V rows, ``q``'s dtype.
      attention_lse: ``[..., S_q, H]`` float natural-log denominator (see above).
      sm_scale: the main attention's softmax scale (Python number; V4: ``head_dim**-0.5``).
      q_positions, kv_positions: ``[..., S_q]`` / ``[..., S_kv]`` integer positions (for the
        compressed entries: the position of the last token of their window).
      q_segment_ids, kv_segment_ids: optional ``[..., S_q]`` / ``[..., S_kv]`` integer document
        ids (both or neither).
      indices: optional ``[..., S_q, K]`` integer compressed-row ids (the sparse form).
      block_q: query rows per block of the ``"xla"`` implementation (Python int >= 1); ``None``
        picks one so that a block's temporaries stay near 64 MiB.
      implementation: a name of :data:`REGISTRY`, a sequence of names (the first that supports
        the call runs), or ``None`` (on a GPU ``("cuda", "xla")``, else ``"xla"``). ``"xla"``:
        pure JAX, any platform. ``"cuda"``: SM90 kernels
        (:mod:`~jax_dsa.ops.indexer.v4_kl_loss.cuda`; ``q``, ``kv`` and the index tensors
        rounded to bfloat16, D_qk 512 or 576, index_head_dim 128, H <= 128 local heads,
        index_n_heads <= 64, K <= 2048; the dense form in chunks of 2048 entries).
      deterministic: ``True``: gradients bitwise identical from run to run (``"cuda"`` sums
        ``d index_k`` in 64-bit fixed point instead of float32 atomics; ``"xla"`` on a GPU
        only under XLA's ``--xla_gpu_deterministic_ops=true``); ``False``: the fastest order;
        ``None`` (default): that XLA flag decides (:mod:`jax_dsa.ops.determinism`).

    Returns:
      A scalar: float32, or float64 when an input is float64 (under x64).

    Raises:
      ValueError: ``sm_scale`` not finite and positive, wrong ranks or shapes (named by
        argument), ``S_kv == 0``, ``block_q < 1``,
        only one of the segment ids given, an unknown implementation or one that does not
        support the call.
      NotImplementedError: the requested implementations are not built in this install.
      TypeError: ``sm_scale`` not a number; ``deterministic`` not None or a bool; non-float
        tensors; ``q``/``kv`` dtypes that differ; non-integer ``indices``, positions, segment ids or ``block_q``.
    """
    name = "v4_indexer_kl_loss"
    REGISTRY.candidates(implementation)  # an unknown name fails before the shape checks
    deterministic = determinism.resolve(name, deterministic)
    index_q, index_k, index_weights, q, kv, attention_lse = (
        jnp.asarray(x) for x in (index_q, index_k, index_weights, q, kv, attention_lse)
    )
    batch, s_q, h_i, s_kv, h, indices, block_q, (q_pos, kv_pos, q_seg, kv_seg) = check_kl_args(
        name, index_q, index_k, index_weights, q, kv, sm_scale, indices, block_q, q_positions,
        kv_positions, q_segment_ids, kv_segment_ids)
    if attention_lse.shape != batch + (s_q, h):
        raise ValueError(
            f"{name}: attention_lse must be [..., S_q, H] = {batch + (s_q, h)}, got "
            f"{attention_lse.shape}"
        )
    if not jnp.issubdtype(attention_lse.dtype, jnp.floating):
        raise TypeError(f"{name}: attention_lse must be a float array, got {attention_lse.dtype}")
    acc = acc_dtype(index_q, index_k, index_weights, q, kv)
    impl = REGISTRY.choose(implementation, describe(acc, index_q, q, s_kv, indices,
                                                    q_seg is not None, False, deterministic))
    operands = flat_operands(batch, index_q, index_k, index_weights,
                             (q_pos, kv_pos, q_seg, kv_seg), q, kv, (attention_lse.astype(acc),),
                             indices)
    config = KLConfig(float(sm_scale), h, block_q, impl, deterministic=deterministic)
    kl, count = kl_call(name, config, V4_ROLES, *operands)
    return mean_of_rows(kl, count, acc)
