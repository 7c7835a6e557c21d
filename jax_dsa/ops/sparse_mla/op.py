"""``sparse_mla``: DeepSeek sparse attention over MLA's shared latent rows (the public op).

The contract is FlashMLA v2's sparse prefill forward (deepseek-ai/FlashMLA,
``flash_mla_sparse_fwd``) with the cuDNN frontend's DSA backward (NVIDIA/cudnn-frontend,
``SparseAttentionBackward``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_dsa import _native
from jax_dsa.ops import determinism
from jax_dsa.ops.checks import check_attention_args, int32_slots
from jax_dsa.ops.registry import Registry
from jax_dsa.ops.sparse_mla import cpu, cuda, sharding, xla
from jax_dsa.ops.sparse_mla.config import Call, Config

# implementation=None on the host prefers "cpu" when it is built: measured faster than "xla"
# there (benchmarks/notes/host_and_xla.md: forward+backward 6.2x faster at the training example's
# shape, 2.3x at a larger one).
REGISTRY = Registry(
    "sparse_mla",
    (xla.IMPLEMENTATION, cpu.IMPLEMENTATION, cuda.IMPLEMENTATION),
    preference={"gpu": ("cuda", "xla"), "cpu": ("cpu", "xla"), "default": ("xla",)},
)
IMPLEMENTATIONS = REGISTRY.names
# The implementations this install can run: "xla" always, "cpu"/"cuda" when their native module
# loaded (see `jax_dsa._native.LOAD_ERRORS` for why one did not).
AVAILABLE = ("xla",) + _native.available()

# Names of the residuals saved for the backward, for `jax.checkpoint` policies such as
# `jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)`.
OUT_NAME = "sparse_mla_out"
LSE_NAME = "sparse_mla_lse"
RESIDUAL_NAMES = (OUT_NAME, LSE_NAME)


def sparse_mla(
    q,
    kv,
    indices,
    *,
    sm_scale,
    d_v: int = 512,
    attn_sink=None,
    topk_length=None,
    implementation: str | None = None,
    return_max_logits: bool = False,
    deterministic: bool | None = None,
):
    """Sparse multi-query attention of each query over its own list of key rows.

    Each query token ``t`` attends, with all of its heads, to the rows ``kv[indices[t, j]]``.
    Keys are the full rows (``D_qk`` wide); values are their first ``d_v`` columns (K = V, as in
    MLA's absorbed form). For query ``t``, head ``h`` and valid slots ``j``::

        s_j   = sm_scale * q[t, h] . kv[indices[t, j]]
        lse   = log(sum_j exp(s_j))                        (natural log, sink excluded)
        out   = sum_j exp(s_j) * kv[indices[t, j], :d_v] / (exp(lse) + exp(attn_sink[h]))
        max_logits = max_j s_j                             (sink excluded)

    A slot ``j`` is invalid when ``indices[t, j] < 0``, ``indices[t, j] >= S_kv`` or
    ``j >= topk_length[t]``; invalid slots are never read. A row with no valid slot gives
    ``out = 0``, ``lse = +inf`` and ``max_logits = -inf`` and passes no gradient. Duplicate
    indices in a row count as separate slots.

    Args:
      q: ``[..., S_q, H, D_qk]`` float16, bfloat16, float32 (or float64 under x64).
      kv: ``[..., S_kv, D_qk]``, q's dtype: one latent row per token, shared by all heads.
      indices: ``[..., S_q, K]`` integer row ids into the same batch element's ``kv``.
      sm_scale: softmax scale (Python number). Required: MLA uses the un-absorbed scale
        (GLM-5: 1/16; DeepSeek V3.2: 192**-0.5 * mscale**2; DeepSeek V4: 512**-0.5), not
        ``D_qk**-0.5``.
      d_v: value width, the first ``d_v`` columns of each kv row; ``0 < d_v <= D_qk``.
      attn_sink: optional ``[H]`` float32 logit per head added to the softmax denominator
        (``-inf`` = no sink). It does not enter ``lse``.
      topk_length: optional ``[..., S_q]`` integer count of leading slots to use per query.
      implementation: a name of :data:`REGISTRY`, a sequence of names (the first that supports
        the call runs), or ``None`` (on a GPU ``("cuda", "xla")``, on the host
        ``("cpu", "xla")``). ``"xla"``: pure JAX, any platform. ``"cpu"``: C++ XLA FFI handlers
        on the host. ``"cuda"``: jax_dsa's own SM90 forward (FlashMLA v2 contract) with the cuDNN
        frontend's SM90 DSA backward, both compiled ahead of time; bfloat16, H <= 128, D_qk 512
        or 576, d_v 512, K <= 2048. :data:`AVAILABLE` lists what this install has built.
      return_max_logits: also return ``max_logits`` (FlashMLA v2's ``max_logits`` output), e.g.
        to monitor the growth of attention logits. Every implementation computes it in the same
        pass as ``out``; when False it is dropped (XLA removes it from the "xla" path; the
        native handlers still write one ``[S_q, H]`` float32 buffer).
      deterministic: ``True``: the backward sums ``dkv`` and ``d_attn_sink`` in a fixed order, so
        that gradients are bitwise identical from run to run (``"cuda"``: jax_dsa's own
        backward kernel in its deterministic mode; ``"xla"`` on a GPU only under XLA's
        ``--xla_gpu_deterministic_ops=true``; ``"cpu"`` always is). ``False``: the fastest
        order. ``None`` (default): that XLA flag decides (:mod:`jax_dsa.ops.determinism`).

    Returns:
      ``(out, lse)``, or ``(out, lse, max_logits)`` when ``return_max_logits``:
      ``out [..., S_q, H, d_v]`` in q's dtype; ``lse [..., S_q, H]`` float32, natural log;
      ``max_logits [..., S_q, H]`` float32, ``sm_scale * max_j q[t, h] . kv[indices[t, j]]``
      over the valid slots in natural units (no log2(e) factor), ``-inf`` for a row without a
      valid slot; ``attn_sink`` enters neither ``lse`` nor ``max_logits``.

    Gradients (``jax.custom_vjp``): ``dq``, ``dkv`` (the key and value contributions summed in
    one buffer) and ``d_attn_sink``. ``indices`` and ``topk_length`` take none. ``lse`` and
    ``max_logits`` are treated as constants: a cotangent flowing into them is ignored (as in
    the cuDNN backward), so a loss of ``max_logits`` alone has zero gradient; wrap them in
    ``jax.lax.stop_gradient`` when using them in a loss to make this explicit. The residuals
    ``out`` and ``lse`` are tagged with :data:`RESIDUAL_NAMES` for ``jax.checkpoint`` policies
    (``max_logits`` is not a residual).

    Raises:
      TypeError: missing ``sm_scale``, non-integer ``indices``/``topk_length``, non-float or
        mismatched ``q``/``kv`` dtypes, ``return_max_logits`` or ``deterministic`` not a bool.
      ValueError: ``sm_scale`` not finite and positive, wrong ranks or shapes (named by
        argument), ``d_v`` out of range, an unknown implementation, or a call that no requested
        implementation supports (each one's reason listed, e.g. ``D_qk`` not in (512, 576) for
        ``"cuda"``).
      NotImplementedError: the requested implementations are not built in this install.
    """
    if not isinstance(return_max_logits, (bool, np.bool_)):
        raise TypeError(
            f"sparse_mla: return_max_logits must be a Python bool, got {return_max_logits!r}"
        )
    return_max_logits = bool(return_max_logits)
    batch, operands, config = prepare(q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                                      attn_sink=attn_sink, topk_length=topk_length,
                                      implementation=implementation,
                                      deterministic=determinism.resolve("sparse_mla",
                                                                        deterministic))
    s_q, h = operands[0].shape[1:3]
    # One custom_vjp with three outputs: dropping max_logits here lets XLA remove what only it
    # needs (the xla path's loop output; the handlers' extra [S_q, H] buffer is all it costs).
    out, lse, max_logits = _sparse_mla(*operands, config)
    out, lse = out.reshape(batch + (s_q, h, d_v)), lse.reshape(batch + (s_q, h))
    if return_max_logits:
        # Native kernels take maxima with fmax, which drops a NaN: a poisoned row's (NaN lse)
        # maximum is NaN too.
        max_logits = jnp.where(jnp.isnan(lse), jnp.nan, max_logits.reshape(batch + (s_q, h)))
        return out, lse, max_logits
    return out, lse


def prepare(q, kv, indices, *, sm_scale, d_v, attn_sink, topk_length, implementation,
            deterministic=False):
    """The checks of :func:`sparse_mla` and its operands on one flattened batch dim:
    ``(batch, (q [NB, S_q, H, D_qk], kv [NB, S_kv, D_qk], indices [NB, S_q, K] int32,
    sink [H], topk_length [NB, S_q] int32), config)``, as :mod:`~jax_dsa.ops.sparse_mla.sharding`
    takes them (for ops built on this one)."""
    q, kv, indices = jnp.asarray(q), jnp.asarray(kv), int32_slots(indices)
    attn_sink = None if attn_sink is None else jnp.asarray(attn_sink)
    topk_length = None if topk_length is None else int32_slots(topk_length)
    impl = _check_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, implementation,
                       deterministic)
    batch = q.shape[:-3]
    s_q, h, d_qk = q.shape[-3:]
    s_kv, topk = kv.shape[-2], indices.shape[-1]
    nb = 1
    for n in batch:
        nb *= n

    q3 = q.reshape((nb, s_q, h, d_qk))
    kv3 = kv.reshape((nb, s_kv, d_qk))
    if indices.dtype != jnp.int32:  # out-of-range wide indices must not wrap into range
        indices = jnp.where((indices >= 0) & (indices < s_kv), indices, -1)
    idx3 = indices.astype(jnp.int32).reshape((nb, s_q, topk))
    if topk_length is None:
        len2 = jnp.full((nb, s_q), topk, jnp.int32)
    else:
        len2 = topk_length.astype(jnp.int32).reshape((nb, s_q))
    if attn_sink is None:
        sink = jnp.full((h,), -jnp.inf, jnp.float32)
    else:
        sink = attn_sink
    config = Config(float(sm_scale), int(d_v), impl, xla.default_block_q(s_q, topk, d_qk),
                    deterministic)
    return batch, (q3, kv3, idx3, sink, len2), config


def _check_args(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, implementation,
                deterministic):
    REGISTRY.candidates(implementation)  # an unknown name fails before the shape checks
    batch = check_attention_args("sparse_mla", q, kv, sm_scale, d_v, attn_sink)
    s_q, h, d_qk = q.shape[-3:]
    if indices.ndim != len(batch) + 2:
        raise ValueError(
            f"sparse_mla: indices must be [..., S_q, K] with q's {len(batch)} batch dims, got "
            f"shape {indices.shape} for q {q.shape}"
        )
    if indices.shape[:-2] != batch:
        raise ValueError(
            f"sparse_mla: batch dims differ: q {batch}, indices {indices.shape[:-2]}"
        )
    if indices.shape[-2] != s_q:
        raise ValueError(f"sparse_mla: indices has S_q {indices.shape[-2]}, q has {s_q}")
    if indices.shape[-1] < 1:
        raise ValueError("sparse_mla: indices must have at least one slot (K >= 1)")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"sparse_mla: indices must be an integer array, got {indices.dtype}")
    if topk_length is not None:
        if topk_length.shape != batch + (s_q,):
            raise ValueError(
                f"sparse_mla: topk_length must be [..., S_q]={batch + (s_q,)}, got "
                f"{topk_length.shape}"
            )
        if not jnp.issubdtype(topk_length.dtype, jnp.integer):
            raise TypeError(
                f"sparse_mla: topk_length must be an integer array, got {topk_length.dtype}"
            )
    return REGISTRY.choose(implementation, Call(jnp.dtype(q.dtype), h, d_qk, int(d_v),
                                                indices.shape[-1], deterministic))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sparse_mla(q, kv, indices, sink, lengths, config: Config):
    return sharding.forward(q, kv, indices, sink, lengths, config)


def _fwd_rule(q, kv, indices, sink, lengths, config):
    out, lse, max_logits = sharding.forward(q, kv, indices, sink, lengths, config)
    out = checkpoint_name(out, OUT_NAME)
    lse = checkpoint_name(lse, LSE_NAME)
    return (out, lse, max_logits), (q, kv, indices, sink, lengths, out, lse)


def _bwd_rule(config, residuals, cotangents):
    q, kv, indices, sink, lengths, out, lse = residuals
    dout = cotangents[0]  # lse and max_logits take no gradient (see the docstring)
    dq, dkv, dsink = sharding.backward(q, kv, indices, sink, lengths, out, lse, dout, config)
    return dq, dkv, None, dsink, None


_sparse_mla.defvjp(_fwd_rule, _bwd_rule)
