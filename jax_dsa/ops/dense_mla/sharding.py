"""How ``dense_mla`` splits over a device mesh: its role tables for
:func:`jax_dsa.sharding.partition.partitioned_call`.

Operands on flattened batches: ``q [NB, S_q, H, D_qk]``, ``kv [NB, S_kv, D_qk]``,
``q_pos [NB, S_q]``, ``kv_pos [NB, S_kv]``, ``q_seg [NB, S_q]`` / ``kv_seg [NB, S_kv]`` (or
absent), ``sink [H]``. The contract of :mod:`jax_dsa.ops.sparse_mla.sharding`: queries, their
positions and the results stay local to their batch / sequence / head shard; ``kv`` and the key
positions / segment ids are gathered along the sequence (positions are global, so a query shard
sees every key it may attend to); ``dkv`` is summed over the local heads and query rows, then
reduce-scattered back over the sequence axes; ``d_attn_sink`` is summed over the local rows.
"""

from __future__ import annotations

from jax_dsa.sharding.partition import Result, partitioned_call, typed_like

FWD_ROLES = ("bsh.", "bt.", "bs", "bt", "bs", "bt", "h")
FWD_RESULTS = (Result("bsh."), Result("bsh"))  # out, lse
BWD_ROLES = FWD_ROLES + ("bsh.", "bsh", "bsh.")  # + out, lse, dout
BWD_RESULTS = (Result("bsh."), Result("bT.", "h"), Result("h", "bs"))  # dq, dkv, d_attn_sink


def forward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, config):
    """``config.implementation``'s forward, split over the mesh in context: ``(out, lse)``."""
    impl = config.implementation

    def local(layout, *a):
        return tuple(impl.forward(*a, config))

    return partitioned_call("dense_mla", local, (q, kv, q_pos, kv_pos, q_seg, kv_seg, sink),
                            FWD_ROLES, FWD_RESULTS)


def backward(q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse, dout, config):
    """``config.backward_implementation``'s backward, split over the mesh in context:
    ``(dq, dkv, d_attn_sink)``, each typed like its primal."""
    impl = config.backward_implementation

    def local(layout, *a):
        return tuple(impl.backward(*a, config))

    dq, dkv, dsink = partitioned_call(
        "dense_mla backward", local,
        (q, kv, q_pos, kv_pos, q_seg, kv_seg, sink, out, lse, dout), BWD_ROLES, BWD_RESULTS)
    return typed_like(dq, q), typed_like(dkv, kv), typed_like(dsink, sink)
