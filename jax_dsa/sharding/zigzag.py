"""Load balance of causal context parallelism: work per shard and the zigzag token layout.

With causal attention and the sequence split into ``cp`` contiguous shards, shard ``r`` holds
queries that see more keys than shard ``r - 1``: the indexer scores (dense warm-up KL as well)
cost about ``2r + 1`` units on shard ``r`` against ``1`` on shard 0. The zigzag layout of
Megatron-LM's context parallelism cuts the sequence into ``2 * cp`` equal chunks and gives shard
``r`` chunks ``r`` and ``2 * cp - 1 - r`` (one early, one late), which evens the work out.

Only the order of tokens changes. Give the model the permuted ``positions`` (and segment ids):
visibility is decided by position (``kv_position <= q_position``), indices into the keys are
rows of the permuted, gathered sequence, and RoPE uses the positions, so the outputs are those of
the natural order, permuted. Undo the permutation on per-token outputs with
:func:`from_zigzag` (a mean loss over tokens needs nothing). One difference remains: the
indexer breaks exact score ties by row, so among keys with exactly equal scores at the top-k
boundary a different one may be chosen.
"""

from __future__ import annotations

import numpy as np


def zigzag_permutation(seq_len: int, cp: int) -> np.ndarray:
    """``perm [seq_len]``: the zigzag layout is ``x[..., perm]`` along the sequence.

    Contiguous shard ``r`` of the permuted sequence (``seq_len / cp`` tokens) holds chunks
    ``r`` and ``2 * cp - 1 - r`` of the natural order, chunks being ``seq_len / (2 * cp)``
    tokens long.

    Raises:
      ValueError: ``cp < 1`` or ``seq_len`` not a multiple of ``2 * cp``.
    """
    if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"zigzag_permutation: cp must be an int >= 1, got {cp!r}")
    if seq_len % (2 * cp):
        raise ValueError(
            f"zigzag_permutation: seq_len {seq_len} must be a multiple of 2 * cp = {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    order = [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in order]).astype(np.int32)


def to_zigzag(x, cp: int, axis: int = 1):
    """``x`` with its sequence ``axis`` put in zigzag order (NumPy or JAX arrays)."""
    perm = zigzag_permutation(x.shape[axis], cp)
    return x.take(perm, axis=axis) if isinstance(x, np.ndarray) else _take(x, perm, axis)


def from_zigzag(x, cp: int, axis: int = 1):
    """Inverse of :func:`to_zigzag`: natural order from zigzag order along ``axis``."""
    inv = np.argsort(zigzag_permutation(x.shape[axis], cp)).astype(np.int32)
    return x.take(inv, axis=axis) if isinstance(x, np.ndarray) else _take(x, inv, axis)


def _take(x, idx, axis):
    import jax.numpy as jnp

    return jnp.take(x, jnp.asarray(idx), axis=axis)


def causal_work(positions, segment_ids=None, topk=None) -> np.ndarray:
    """Work units per query token: the keys it can see (indexer scores, dense attention, the
    dense KL loss), or ``min(topk, visible)`` (sparse attention slots, sparse KL).

    Keys visible to query ``t`` are those with ``position <= position[t]`` in the same segment
    (as :func:`jax_dsa.ops.indexer.visible_mask`), counted by brute force over sorted keys.

    Args:
      positions: ``[S]`` integer positions of one row (any order: natural or zigzag).
      segment_ids: optional ``[S]`` document ids.
      topk: optional slot count of the sparse attention.

    Returns:
      ``[S]`` int64 work per token, in the row's order.
    """
    positions = np.asarray(positions, np.int64)
    seg = np.zeros_like(positions) if segment_ids is None else np.asarray(segment_ids, np.int64)
    work = np.zeros(positions.shape, np.int64)
    for s in np.unique(seg):
        rows = np.nonzero(seg == s)[0]
        keys = np.sort(positions[rows])
        work[rows] = np.searchsorted(keys, positions[rows], side="right")
    if topk is not None:
        work = np.minimum(work, int(topk))
    return work


def work_per_shard(work, cp: int) -> np.ndarray:
    """``[cp]`` sums of per-token ``work [S]`` over ``cp`` contiguous shards of the row."""
    work = np.asarray(work)
    if work.shape[-1] % cp:
        raise ValueError(f"work_per_shard: length {work.shape[-1]} not a multiple of cp={cp}")
    return work.reshape(work.shape[:-1] + (cp, -1)).sum(-1)


def imbalance(per_shard) -> float:
    """``max / mean`` of the work per shard (1.0 = balanced)."""
    per_shard = np.asarray(per_shard, np.float64)
    return float(per_shard.max() / per_shard.mean())
