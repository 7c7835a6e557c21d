"""Query blocks and accumulation types shared by the pure-JAX implementations.

The ``"xla"`` implementations process queries in blocks (``lax.map`` / ``lax.scan``) so that the
largest temporary is one block's: memory grows linearly in the sequence length, never with
``S_q * S_kv``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Elements in one query block's largest temporary (~64 MiB of float32).
BLOCK_ELEMENTS = 1 << 24
MAX_BLOCK_Q = 128

_HIGHEST = jax.lax.Precision.HIGHEST


def einsum(spec, a, b, acc):
    # HIGHEST: float32 inputs must not be rounded to TF32 on GPUs; 16-bit inputs multiply exactly.
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=acc)


def acc_dtype(*xs):
    """float32 for 16-bit inputs, the inputs' own type when it is wider (float64 oracles)."""
    return jnp.promote_types(jnp.result_type(*(x.dtype for x in xs)), jnp.float32)


def default_block_q(s_q, per_row, max_block=MAX_BLOCK_Q):
    """Largest power of two <= ``max_block`` with ``block * per_row <= BLOCK_ELEMENTS``, no more
    than the smallest power of two covering ``s_q``."""
    block = max_block
    while block > 1 and block * per_row > BLOCK_ELEMENTS:
        block //= 2
    while block > 1 and block // 2 >= s_q:
        block //= 2
    return block


def flatten_batch(batch, q, k, w, q_pos, kv_pos, q_seg, kv_seg):
    nb = 1
    for n in batch:
        nb *= n
    nbd = len(batch)

    def flat(x):
        return None if x is None else x.reshape((nb,) + x.shape[nbd:])

    return tuple(flat(x) for x in (q, k, w, q_pos, kv_pos, q_seg, kv_seg))


def blocks_of(block_q, *xs):
    """Each ``[S_q, ...]`` array -> ``[n_blocks, block_q, ...]``; ``None`` stays ``None``.

    Padding rows are zeros (``False`` for booleans, so a row mask drops them from reductions).
    """
    out = []
    for x in xs:
        if x is None:
            out.append(None)
            continue
        s = x.shape[0]
        n = -(-s // block_q)
        pad = n * block_q - s
        if pad:
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        out.append(x.reshape((n, block_q) + x.shape[1:]))
    return tuple(out)


def unblock(x, s):
    return x.reshape((-1,) + x.shape[2:])[:s]
