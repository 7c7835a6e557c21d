"""DeepSeek V4 KV compression: where the compressed entries of a (packed) row come from, and the
softmax-gated pooling that makes them.

Math: DeepSeek-V4 technical report §2.3 (CSA eqs. 9-12, HCA eqs. 20-23) as implemented in
transformers 5.24 (``DeepseekV4CSACompressor``, ``DeepseekV4HCACompressor``,
``DeepseekV4Indexer``) and deepseek-ai's ``inference/model.py`` (``Compressor``). With ratio ``m``,
compressed entry ``i`` of a document pools the tokens of its window ``i`` (document positions
``i*m .. i*m + m - 1``)::

    HCA (non-overlapping):  c_i = sum_{j<m}  softmax_j(z[i*m+j] + B[j]) * kv[i*m+j]
    CSA (overlap, width 2m): the softmax runs over 2m slots, the m tokens of window i-1 with
        their first halves (kv[..., :D], z[..., :D] + B[:, :D]) and the m tokens of window i
        with their second halves (kv[..., D:], z[..., D:] + B[:, D:]); window -1 has weight 0.

elementwise per feature, then RMSNorm and RoPE at the window's first position ``i*m`` (the
caller's job). Entry ``i`` is visible to a query at document position ``p`` iff
``i < (p + 1) // m``: its whole window lies in the query's past. A document of ``L`` tokens has
``L // m`` entries; an incomplete last window makes none.

Packed rows. A row holds documents back to back; ``positions`` count 0, 1, 2, ... within each
document (this is what defines the documents here, so that positions alone suffice; segment ids,
when given, label the entries for visibility checks). Each document is compressed on its own:
an entry is made at every row whose position ``p`` has ``(p + 1) % m == 0`` (the last token of a
complete window), and the entries of a row are stored in row order, so the compressed rows are
the concatenation of the documents' pools. A row of ``S`` tokens never has more than ``S // m``
entries; unused compressed rows are marked invalid.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from jax_dsa.sharding.constraints import whole

# Position given to compressed rows that hold no entry: no query position reaches it.
NO_ENTRY_POSITION = jnp.iinfo(jnp.int32).max


class CompressionLayout(typing.NamedTuple):
    """Where a row's compressed entries come from (``C = S // ratio`` rows, some unused).

    Attributes:
      ratio: the compression ratio ``m`` (Python int).
      end_rows: ``[B, C]`` int32 row of each entry's last token; ``S`` for an unused row.
      valid: ``[B, C]`` bool, the row holds an entry.
      positions: ``[B, C]`` int32 document position of each entry's last token (``p`` with
        ``(p + 1) % m == 0``); :data:`NO_ENTRY_POSITION` for unused rows. An entry is visible to
        a query of the same document iff ``positions[c] <= q_position``.
      segment_ids: ``[B, C]`` int32 document label of each entry: the caller's segment id, or the
        row of the document's first token when no segment ids were given; ``-1`` for unused rows.
      window_start: ``[B, C]`` int32 document position of the entry's window start ``i * m``
        (the RoPE position of the entry); 0 for unused rows.
      first: ``[B, S]`` int32 index of the first compressed row of each query's document.
      count: ``[B, S]`` int32 number of entries visible to each query (those are the compressed
        rows ``first .. first + count - 1``).
    """

    ratio: int
    end_rows: jax.Array
    valid: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    window_start: jax.Array
    first: jax.Array
    count: jax.Array


def document_start(positions):
    """``[B, S]`` row of each token's document start, ``row - position`` clipped at 0."""
    rows = jnp.arange(positions.shape[-1], dtype=jnp.int32)
    return jnp.maximum(rows - positions.astype(jnp.int32), 0)


def query_segments(positions, segment_ids=None):
    """The document label of each query, as :class:`CompressionLayout` labels its entries."""
    if segment_ids is not None:
        return segment_ids.astype(jnp.int32)
    return document_start(positions)


def compression_layout(positions, ratio: int, segment_ids=None) -> CompressionLayout:
    """The compressed-entry layout of rows with per-document ``positions``.

    Args:
      positions: ``[B, S]`` integer positions, 0, 1, 2, ... within each document of a row.
      ratio: compression ratio ``m >= 2`` (Python int).
      segment_ids: optional ``[B, S]`` integer document ids (labels only; documents are
        delimited by ``positions``).

    Returns:
      A :class:`CompressionLayout` with ``C = S // ratio`` compressed rows per batch row.

    Raises:
      ValueError: ``positions`` not ``[B, S]`` or ``ratio < 2``.
    """
    if positions.ndim != 2:
        raise ValueError(f"compression_layout: positions must be [B, S], got {positions.shape}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 2:
        raise ValueError(f"compression_layout: ratio must be an int >= 2, got {ratio!r}")
    b, s = positions.shape
    c = s // ratio
    # a scan along each row: on Explicit mesh axes the (small) rows come whole
    positions, segment_ids = whole(positions.astype(jnp.int32), 1), whole(segment_ids, 1)
    is_end = (positions + 1) % ratio == 0
    incl = jnp.cumsum(is_end.astype(jnp.int32), axis=1)
    excl = incl - is_end.astype(jnp.int32)
    rows = jnp.arange(s, dtype=jnp.int32)
    slot = jnp.where(is_end, excl, c)  # c: dropped by the scatter

    def one(slot_b):
        return jnp.full((c,), s, jnp.int32).at[slot_b].set(rows, mode="drop")

    end_rows = jax.vmap(one)(slot)
    valid = end_rows < s
    safe = jnp.minimum(end_rows, s - 1)
    take = jax.vmap(lambda a, i: a[i])
    end_pos = take(positions, safe)
    entry_pos = jnp.where(valid, end_pos, NO_ENTRY_POSITION)
    seg = take(query_segments(positions, segment_ids), safe)
    entry_seg = jnp.where(valid, seg, -1)
    window_start = jnp.where(valid, end_pos - (ratio - 1), 0)
    doc0 = document_start(positions)
    first = take(excl, doc0)
    count = incl - first
    return CompressionLayout(
        ratio, end_rows, valid, entry_pos, entry_seg, window_start, first, count
    )


def pool(kv, gate, position_bias, layout: CompressionLayout, *, overlap: bool):
    """Softmax-gated pooling of each entry's window (before the RMSNorm and RoPE).

    Args:
      kv, gate: ``[B, S, W]`` per-token projections (``W = D``, or ``2 D`` with ``overlap``).
      position_bias: ``[m, W]`` learned bias on the gate logits per slot of the window (``ape``).
      layout: from :func:`compression_layout` with ratio ``m``.
      overlap: CSA's overlapping windows of width ``2m`` (see the module docstring).

    Returns:
      ``[B, C, D]`` pooled rows in ``kv``'s dtype, zero on unused compressed rows. The gate
      softmax runs in float32 (float64 for float64 inputs).
    """
    m = layout.ratio
    s, w = kv.shape[1], kv.shape[2]
    if position_bias.shape != (m, w):
        raise ValueError(
            f"pool: position_bias must be [ratio, W] = {(m, w)}, got {position_bias.shape}"
        )
    kv, gate = whole(kv, 1), whole(gate, 1)  # windows cross sequence shards: gather them
    acc = jnp.promote_types(kv.dtype, jnp.float32)
    bias = position_bias.astype(acc)
    offs = jnp.arange(m, dtype=jnp.int32)
    cur = layout.end_rows[..., None] - (m - 1) + offs  # [B, C, m] rows of window i
    gather = jax.vmap(lambda a, i: a[jnp.clip(i, 0, s - 1)])
    if overlap:
        if w % 2:
            raise ValueError(f"pool: overlapping windows need an even width, got W={w}")
        d = w // 2
        # Window i-1 exists in the same document iff the entry's last position is >= 2m - 1.
        has_prev = layout.valid & (layout.positions >= 2 * m - 1)
        kv_prev = gather(kv[..., :d], cur - m).astype(acc)
        z_prev = gather(gate[..., :d], cur - m).astype(acc) + bias[:, :d]
        z_prev = jnp.where(has_prev[..., None, None], z_prev, -jnp.inf)
        kv_cur = gather(kv[..., d:], cur).astype(acc)
        z_cur = gather(gate[..., d:], cur).astype(acc) + bias[:, d:]
        kv_win = jnp.concatenate([kv_prev, kv_cur], axis=-2)
        z_win = jnp.concatenate([z_prev, z_cur], axis=-2)
    else:
        kv_win = gather(kv, cur).astype(acc)
        z_win = gather(gate, cur).astype(acc) + bias
    weights = jax.nn.softmax(z_win, axis=-2)
    pooled = jnp.sum(weights * kv_win, axis=-2)
    return jnp.where(layout.valid[..., None], pooled, 0).astype(kv.dtype)


__all__ = [
    "NO_ENTRY_POSITION",
    "CompressionLayout",
    "compression_layout",
    "document_start",
    "pool",
    "query_segments",
]
