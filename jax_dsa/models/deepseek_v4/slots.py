"""Slot lists of DeepSeek V4 attention: ``[window | compressed]`` per query, bucketed widths.

Every V4 layer makes one :func:`jax_dsa.sparse_mla` call over ``kv = [raw rows (S) ; compressed
rows (C)]``. Query ``t`` (document position ``p``) attends to

* its window: the raw rows ``t - n_w + 1 .. t`` with ``n_w = min(p + 1, sliding_window)`` (the
  window never crosses its document's start), and
* compressed rows (offset by ``S``): the CSA indexer's top-k, or for HCA (and CSA's dense
  warm-up) every visible entry of its document.

The valid slots form a prefix (window first, then compressed), ``topk_length`` is their count, and
the rest is ``-1``, so a kernel that honours ``topk_length`` spends nothing on padding (the cuDNN
backward wants exactly this prefix form).

Slot width. The width is a compile-time constant of the GPU kernels (one artifact per width) and a
static shape for XLA. It is ``window + compressed slots``: 128 for window-only layers, ``128 +
index_topk`` for CSA (640 V4-Flash, 1152 V4-Pro) and ``128 + S // 128`` for HCA, which grows with
the sequence. Widths are rounded up to :data:`SLOT_BUCKETS`, a ladder of multiples of 128:
every multiple of 128 up to 1152 (so the fixed CSA widths are hit exactly), then
``2**k`` and ``1.5 * 2**k`` (1536, 2048, 3072, 4096, 6144, ...; at most 50 % padding). HCA over
sequence lengths 1K..32K needs two widths (256, 384); 1M tokens needs 12288.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsa.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config

SLOT_ALIGN = 128
# Multiples of 128 up to 1152, then 2**k and 1.5 * 2**k up to 2**24.
SLOT_BUCKETS: tuple[int, ...] = tuple(range(128, 1152 + 1, 128)) + tuple(
    sorted({v for k in range(10, 25) for v in (2**k, 3 * 2 ** (k - 1)) if v > 1152})
)


def slot_bucket(n: int) -> int:
    """The smallest entry of :data:`SLOT_BUCKETS` that is ``>= n`` (``n >= 1``).

    Raises:
      ValueError: ``n < 1`` or beyond the ladder.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"slot_bucket: n must be an int >= 1, got {n!r}")
    for b in SLOT_BUCKETS:
        if b >= n:
            return b
    raise ValueError(f"slot_bucket: {n} slots exceed the ladder's largest width {SLOT_BUCKETS[-1]}")


def compressed_slot_count(
    config: DeepseekV4Config, layer_type: str, seq_len: int, attention_mode: str = "sparse"
) -> int:
    """Compressed slots per query (before bucketing) for rows of ``seq_len`` tokens: 0 for
    window-only layers, ``index_topk`` for CSA in sparse mode (fixed, even when fewer entries
    exist, so that every length shares one width), ``S // m`` for HCA and for CSA in dense
    mode."""
    if layer_type == SLIDING:
        return 0
    if layer_type == CSA and attention_mode == "sparse":
        return config.index_topk
    return seq_len // config.compress_rates[layer_type]


def slot_width(
    config: DeepseekV4Config, layer_type: str, seq_len: int, attention_mode: str = "sparse"
) -> int:
    """The bucketed slot width of one layer type at ``seq_len``:
    ``slot_bucket(min(sliding_window, S) + compressed_slot_count(...))``."""
    if layer_type not in (SLIDING, CSA, HCA):
        raise ValueError(f"slot_width: unknown layer_type {layer_type!r}")
    raw = min(config.sliding_window, seq_len) + compressed_slot_count(
        config, layer_type, seq_len, attention_mode
    )
    return slot_bucket(raw)


def window(positions, sliding_window: int):
    """First window row and window length per query: ``([B, S], [B, S])`` int32."""
    rows = jnp.arange(positions.shape[-1], dtype=jnp.int32)
    # The row bound keeps the window inside the row if positions do not start at 0 there.
    n_w = jnp.minimum(jnp.minimum(positions.astype(jnp.int32), rows) + 1, sliding_window)
    n_w = jnp.maximum(n_w, 1)
    return rows - n_w + 1, n_w


def assemble(
    first_row, n_window, width: int, *, compressed=None, compressed_first=None,
    compressed_count=None, compressed_offset: int = 0,
):
    """``[window | compressed | -1 ...]`` slot lists of a fixed ``width`` and their lengths.

    Args:
      first_row, n_window: ``[B, S]`` from :func:`window`.
      width: slots per query (Python int; at least the largest ``n_window + compressed count``).
      compressed: optional ``[B, S, K]`` compressed-row ids, valid ones first, ``-1`` after them
        (the indexer's top-k).
      compressed_first, compressed_count: optional ``[B, S]`` contiguous range of compressed rows
        instead (``first .. first + count - 1``: HCA, dense CSA).
      compressed_offset: added to compressed-row ids (``S``: they follow the raw rows in kv).

    Returns:
      ``indices [B, S, width]`` int32 (``-1`` padded) and ``topk_length [B, S]`` int32. No
      gradient.
    """
    j = jnp.arange(width, dtype=jnp.int32)
    nw = n_window[..., None]
    idx = jnp.where(j < nw, first_row[..., None] + j, -1)
    length = n_window
    if compressed is not None:
        k = compressed.shape[-1]
        n_c = jnp.sum(compressed >= 0, axis=-1).astype(jnp.int32)
        cj = jnp.clip(j - nw, 0, k - 1)
        comp = jnp.take_along_axis(compressed.astype(jnp.int32), cj, axis=-1)
        in_comp = (j >= nw) & (j < nw + n_c[..., None])
        idx = jnp.where(in_comp, comp + compressed_offset, idx)
        length = n_window + n_c
    elif compressed_first is not None:
        n_c = compressed_count.astype(jnp.int32)
        comp = compressed_first[..., None] + (j - nw)
        in_comp = (j >= nw) & (j < nw + n_c[..., None])
        idx = jnp.where(in_comp, comp + compressed_offset, idx)
        length = n_window + n_c
    return jax.lax.stop_gradient(idx), jax.lax.stop_gradient(length)


__all__ = [
    "SLOT_ALIGN",
    "SLOT_BUCKETS",
    "assemble",
    "compressed_slot_count",
    "slot_bucket",
    "slot_width",
    "window",
]
