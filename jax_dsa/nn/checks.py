"""Input checks shared by the attention layers and language models of both families: positions
and segment ids ``[B, S]`` (with the ``arange`` default), token ids, the attention mode."""

from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.sharding import constrain


def check_positions(positions, segment_ids, batch: int, seq: int):
    """Default ``positions`` (``arange`` per row) and validate shapes; returns both.

    Raises:
      ValueError: ``positions`` / ``segment_ids`` not ``[B, S]``.
      TypeError: non-integer positions or segment ids.
    """
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
        if arr is None:
            continue
        if arr.shape != (batch, seq):
            raise ValueError(f"{name} must be [B, S] = {(batch, seq)}, got shape {arr.shape}")
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {arr.dtype}")
    return positions, segment_ids


def check_lm_inputs(input_ids, positions, segment_ids, attention_mode, modes):
    """Validates an LM call; returns ``input_ids, positions, segment_ids`` (defaults filled in)
    placed like the tokens under the logical axis rules."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {input_ids.shape}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must be an integer array, got {input_ids.dtype}")
    if attention_mode not in modes:
        raise ValueError(f"attention_mode must be one of {modes}, got {attention_mode!r}")
    b, s = input_ids.shape
    positions, segment_ids = check_positions(positions, segment_ids, b, s)
    # the defaults and a caller's own placement alike: on Explicit mesh axes everything derived
    # from them must split as the activations do
    tokens = ("batch", "sequence")
    return constrain(input_ids, tokens), constrain(positions, tokens), (
        None if segment_ids is None else constrain(segment_ids, tokens))


__all__ = ["check_lm_inputs", "check_positions"]
