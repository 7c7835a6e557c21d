"""``dense_mla``: dense causal attention over MLA's shared latent rows (the public op).

The dense warm-up stage of DSA (DeepSeek-V3.2 paper, arXiv:2512.02556, §2.1) attends to every
visible key. ``dense_mla`` computes exactly what :func:`jax_dsa.sparse_mla` computes over the slot
list of every visible key (:func:`jax_dsa.nn.slots.dense_indices`), from positions and segment
ids instead of that ``[S_q, S_kv]`` list.

Implementations. :data:`REGISTRY` holds :class:`jax_dsa.ops.registry.Implementation` objects;
adding one is a module with its ``Implementation`` and one entry in :data:`REGISTRY` (and its
name in the GPU preference). On flattened batches (``NB`` = product of the batch dims), for the
local shard of a device mesh (keys whole):

* ``forward(q [NB, S_q, H, D_qk], kv [NB, S_kv, D_qk], q_pos [NB, S_q] int32,
  kv_pos [NB, S_kv] int32, q_seg [NB, S_q] int32 | None, kv_seg [NB, S_kv] int32 | None,
  sink [H] float, config: Config) -> (out [NB, S_q, H, d_v] q.dtype, lse [NB, S_q, H] float32)``
  with ``lse`` natural-log and sink-free, ``+inf`` (and ``out = 0``) where a row sees no key;
* ``backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse, dout, config)
  -> (dq, dkv, d_sink)`` (``dq`` / ``dkv`` in q's / kv's dtype, ``d_sink [H]``), or ``None``:
  the forward is then paired with the ``"xla"`` backward, which recomputes the probabilities
  from ``q``, ``kv``, the positions and the forward's ``lse`` (so a kernel forward only has to
  agree with it on ``out`` and ``lse``).

``config`` is :class:`jax_dsa.ops.dense_mla.config.Config` (``sm_scale``, ``d_v``, ...); the
``supported`` check sees :class:`jax_dsa.ops.dense_mla.config.Call`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_dsa.ops.dense_mla import cuda, sharding, xla
from jax_dsa.ops.dense_mla.config import Call, Config
from jax_dsa.ops.checks import check_positions
from jax_dsa.ops.checks import check_attention_args
from jax_dsa.ops import determinism
from jax_dsa.ops.registry import Registry

REGISTRY = Registry(
    "dense_mla", (xla.IMPLEMENTATION, cuda.IMPLEMENTATION),
    preference={"gpu": ("cuda", "xla"), "default": ("xla",)},
)
IMPLEMENTATIONS = REGISTRY.names

# Names of the residuals saved for the backward, for `jax.checkpoint` policies such as
# `jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES)`.
OUT_NAME = "dense_mla_out"
LSE_NAME = "dense_mla_lse"
RESIDUAL_NAMES = (OUT_NAME, LSE_NAME)


def dense_mla(
    q,
    kv,
    *,
    sm_scale,
    d_v: int = 512,
    q_positions,
    kv_positions,
    q_segment_ids=None,
    kv_segment_ids=None,
    attn_sink=None,
    implementation: str | None = None,
    deterministic: bool | None = None,
):
    """Dense multi-query attention of each query over every key it may see.

    Key ``s`` is visible to query ``t`` iff ``kv_positions[s] <= q_positions[t]`` and, with
    segment ids, ``kv_segment_ids[s] == q_segment_ids[t]``
    (:func:`jax_dsa.ops.indexer.visible_mask`). Keys are the full rows (``D_qk`` wide); values
    are their first ``d_v`` columns (K = V, MLA's absorbed form). For query ``t``, head ``h``
    and its visible keys ``s``::

        s_ts  = sm_scale * q[t, h] . kv[s]
        lse   = log(sum_s exp(s_ts))                       (natural log, sink excluded)
        out   = sum_s exp(s_ts) * kv[s, :d_v] / (exp(lse) + exp(attn_sink[h]))

    the same values as :func:`jax_dsa.sparse_mla` over the list of every visible key
    (``sparse_mla(q, kv, dense_indices(q_positions, kv_positions, ...), ...)``). A row with no
    visible key gives ``out = 0``, ``lse = +inf`` and passes no gradient.

    Args:
      q: ``[..., S_q, H, D_qk]`` float16, bfloat16, float32 (or float64 under x64).
      kv: ``[..., S_kv, D_qk]``, q's dtype: one latent row per token, shared by all heads.
      sm_scale: softmax scale (Python number). Required: MLA uses the un-absorbed scale
        (GLM-5: 1/16; DeepSeek V3.2: 192**-0.5 * mscale**2; DeepSeek V4: 512**-0.5), not
        ``D_qk**-0.5``.
      d_v: value width, the first ``d_v`` columns of each kv row; ``0 < d_v <= D_qk``.
      q_positions: ``[..., S_q]`` integer positions of the queries (required).
      kv_positions: ``[..., S_kv]`` integer positions of the keys (required). Positions and
        segment ids are compared as int32.
      q_segment_ids, kv_segment_ids: optional ``[..., S_q]`` / ``[..., S_kv]`` integer document
        ids of packed rows, both or neither.
      attn_sink: optional ``[H]`` float logit per head added to the softmax denominator
        (``-inf`` = no sink). It does not enter ``lse``.
      implementation: a name of :data:`REGISTRY`, a sequence of names (the first that supports
        the call runs), or ``None`` (the platform's preference). ``"xla"``: pure JAX, any
        platform; queries in blocks against every key, memory linear in the sequence.
      deterministic: as for :func:`jax_dsa.sparse_mla` (``"cuda"`` runs the same backward).

    Returns:
      ``(out, lse)``: ``out [..., S_q, H, d_v]`` in q's dtype; ``lse [..., S_q, H]`` float32,
      natural log, sink excluded.

    Gradients (``jax.custom_vjp``): ``dq``, ``dkv`` (the key and value contributions summed in
    one buffer) and ``d_attn_sink``; positions and segment ids take none, and ``lse`` is treated
    as a constant (a cotangent flowing into it is ignored, as in :func:`jax_dsa.sparse_mla`).
    The residuals ``out`` and ``lse`` are tagged with :data:`RESIDUAL_NAMES`.

    Raises:
      TypeError: missing ``sm_scale`` or positions, non-float or mismatched ``q``/``kv``
        dtypes, non-integer positions or segment ids, a non-float ``attn_sink``,
        ``deterministic`` not None or a bool.
      ValueError: ``sm_scale`` not finite and positive, wrong ranks or shapes (named by
        argument), ``d_v`` out of range, only one of the segment ids, an unknown implementation,
        or a call that no requested implementation supports (each one's reason listed).
      NotImplementedError: the requested implementations are not built in this install.
    """
    batch, operands, config = prepare(
        q, kv, sm_scale=sm_scale, d_v=d_v, q_positions=q_positions, kv_positions=kv_positions,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, attn_sink=attn_sink,
        implementation=implementation,
        deterministic=determinism.resolve("dense_mla", deterministic))
    s_q, h = operands[0].shape[1:3]
    out, lse = _dense_mla(*operands, config)
    return out.reshape(batch + (s_q, h, d_v)), lse.reshape(batch + (s_q, h))


def prepare(q, kv, *, sm_scale, d_v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
            attn_sink, implementation, deterministic=False):
    """The checks of :func:`dense_mla` and its operands on one flattened batch dim:
    ``(batch, (q, kv, q_pos, kv_pos, q_seg, kv_seg, sink), config)``, as
    :mod:`~jax_dsa.ops.dense_mla.sharding` takes them (for ops built on this one)."""
    q, kv = jnp.asarray(q), jnp.asarray(kv)
    attn_sink = None if attn_sink is None else jnp.asarray(attn_sink)
    impl, (q_pos, kv_pos, q_seg, kv_seg) = _check_args(
        q, kv, sm_scale, d_v, attn_sink, implementation, q_positions, kv_positions,
        q_segment_ids, kv_segment_ids, deterministic)
    batch = q.shape[:-3]
    s_q, h, d_qk = q.shape[-3:]
    s_kv = kv.shape[-2]
    nb = math.prod(batch)

    def flat(x, s):
        return None if x is None else x.astype(jnp.int32).reshape((nb, s))

    q3 = q.reshape((nb, s_q, h, d_qk))
    kv3 = kv.reshape((nb, s_kv, d_qk))
    q_pos, q_seg = flat(q_pos, s_q), flat(q_seg, s_q)
    kv_pos, kv_seg = flat(kv_pos, s_kv), flat(kv_seg, s_kv)
    sink = jnp.full((h,), -jnp.inf, jnp.float32) if attn_sink is None else attn_sink
    backward_impl = impl if impl.backward is not None else REGISTRY["xla"]
    config = Config(float(sm_scale), int(d_v), impl, backward_impl,
                    xla.default_block_q(s_q, h, s_kv), deterministic)
    return batch, (q3, kv3, q_pos, kv_pos, q_seg, kv_seg, sink), config


def _check_args(q, kv, sm_scale, d_v, attn_sink, implementation, q_positions, kv_positions,
                q_segment_ids, kv_segment_ids, deterministic):
    REGISTRY.candidates(implementation)  # an unknown name fails before the shape checks
    batch = check_attention_args("dense_mla", q, kv, sm_scale, d_v, attn_sink)
    s_q, h, d_qk = q.shape[-3:]
    s_kv = kv.shape[-2]
    visibility = check_positions("dense_mla", q_positions, kv_positions, q_segment_ids,
                                 kv_segment_ids, batch + (s_q,), batch + (s_kv,))
    call = Call(jnp.dtype(q.dtype), h, d_qk, int(d_v), s_q, s_kv, q_segment_ids is not None,
                deterministic)
    return REGISTRY.choose(implementation, call), visibility


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _dense_mla(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config: Config):
    return sharding.forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config)


def _fwd_rule(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config):
    out, lse = sharding.forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config)
    out = checkpoint_name(out, OUT_NAME)
    lse = checkpoint_name(lse, LSE_NAME)
    return (out, lse), (q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse)


def _bwd_rule(config, residuals, cotangents):
    q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse = residuals
    dout = cotangents[0]  # lse takes no gradient (see the docstring)
    dq, dkv, dsink = sharding.backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse,
                                       dout, config)
    return dq, dkv, None, None, None, None, dsink


_dense_mla.defvjp(_fwd_rule, _bwd_rule)
