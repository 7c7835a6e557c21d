"""How ``sparse_mla`` splits over a device mesh: its role tables for
:func:`jax_dsa.sharding.partition.partitioned_call`.

Operands on flattened batches: ``q [NB, S_q, H, D_qk]``, ``kv [NB, S_kv, D_qk]``,
``indices [NB, S_q, K]``, ``sink [H]``, ``lengths [NB, S_q]``. Queries, indices and results stay
local to their batch / sequence / head shard; ``kv`` is gathered along the sequence (the indices
are global rows); ``dkv`` is summed over the local heads and query rows, then reduce-scattered
back over the sequence axes; ``d_attn_sink`` is summed over the local rows.
"""

from __future__ import annotations

from jax_dsa.sharding.partition import Result, partitioned_call, typed_like

FWD_ROLES = ("bsh.", "bt.", "bs.", "h", "bs")
FWD_RESULTS = (Result("bsh."), Result("bsh"), Result("bsh"))  # out, lse, max_logits
BWD_ROLES = FWD_ROLES + ("bsh.", "bsh", "bsh.")  # + out, lse, dout
BWD_RESULTS = (Result("bsh."), Result("bT.", "h"), Result("h", "bs"))  # dq, dkv, d_attn_sink


def forward(q, kv, indices, sink, lengths, config):
    """``config.implementation``'s forward, split over the mesh in context:
    ``(out, lse, max_logits)``."""
    impl = config.implementation

    def local(layout, *a):
        return tuple(impl.forward(*a, config))

    return partitioned_call("sparse_mla", local, (q, kv, indices, sink, lengths), FWD_ROLES,
                            FWD_RESULTS)


def backward(q, kv, indices, sink, lengths, out, lse, dout, config):
    """``config.implementation``'s backward, split over the mesh in context:
    ``(dq, dkv, d_attn_sink)``, each typed like its primal."""
    impl = config.implementation

    def local(layout, *a):
        return tuple(impl.backward(*a, config))

    dq, dkv, dsink = partitioned_call(
        "sparse_mla backward", local, (q, kv, indices, sink, lengths, out, lse, dout), BWD_ROLES,
        BWD_RESULTS)
    return typed_like(dq, q), typed_like(dkv, kv), typed_like(dsink, sink)
