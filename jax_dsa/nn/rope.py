"""Rotary position embedding (RoPE) with YaRN frequencies, interleaved or half-split.

Sources: RoFormer (Su et al., 2021, arXiv:2104.09864); YaRN (Peng et al., 2023,
arXiv:2309.00071) as implemented in DeepSeek-V3.2-Exp ``inference/model.py``
(``precompute_freqs_cis``, ``apply_rotary_emb``) and transformers ``_compute_yarn_parameters``.

Layouts. Both rotate pairs ``(a_i, b_i)`` by the angle ``pos * inv_freq[i]``:

* interleaved (GPT-J, ``interleave=True``): pairs are adjacent, ``(x[2i], x[2i+1])``; the result
  keeps that layout (DeepSeek's ``apply_rotary_emb(..., interleaved=True)``). transformers'
  ``apply_rotary_pos_emb_interleave`` returns the same numbers permuted to the half-split order;
  since q and k are permuted alike, every dot product, and so attention and indexer scores, is
  identical.
* half-split (GPT-NeoX, ``interleave=False``): pairs are ``(x[i], x[i + d/2])``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jax_dsa.nn.rope_parameters import RopeParameters


def inv_frequencies(rope_parameters: RopeParameters, dim: int) -> np.ndarray:
    """Inverse frequencies ``[dim // 2]`` float64 (NumPy, computed once at trace time).

    Plain RoPE: ``theta ** (-2i / dim)``. YaRN: a linear ramp between the interpolated
    (``/ factor``) and the original frequencies over the correction range found from
    ``beta_fast`` / ``beta_slow`` rotations within ``original_max_position_embeddings``.

    Raises:
      ValueError: ``dim`` not a positive even int.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"inv_frequencies: dim must be a positive even int, got {dim}")
    p = rope_parameters
    base = float(p.rope_theta)
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if p.rope_type != "yarn":
        return freqs

    def correction_dim(rotations):
        return dim * math.log(p.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base)
        )

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: original frequency (high freqs), 0: interpolated (low freqs)
    return freqs / p.factor * (1.0 - keep) + freqs * keep


def rope_cos_sin(positions, rope_parameters: RopeParameters, dim: int):
    """``cos`` and ``sin`` of ``positions * inv_freq``, each ``positions.shape + (dim // 2,)``.

    Computed in float32 and multiplied by YaRN's ``cos_sin_scale`` (1 for the shipped presets).

    Args:
      positions: integer array of token positions (any shape).
      rope_parameters: the model's :class:`~jax_dsa.configs.RopeParameters`.
      dim: number of rotated dims (``qk_rope_head_dim``).
    """
    inv = jnp.asarray(inv_frequencies(rope_parameters, dim), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv
    scale = rope_parameters.cos_sin_scale
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x, cos, sin, *, interleave: bool):
    """Rotate the last dim of ``x`` (width ``d``) by angles with ``cos``/``sin`` ``[..., d/2]``.

    Args:
      x: ``[..., d]`` float array; ``cos``/``sin`` must broadcast against ``x[..., : d // 2]``.
      interleave: pairs ``(x[2i], x[2i+1])`` if true, else ``(x[i], x[i + d/2])``.

    Returns:
      The rotated array, ``x``'s shape and dtype (the rotation runs in float32 or wider).

    Raises:
      ValueError: ``x``'s last dim is not ``2 * cos.shape[-1]``.
    """
    d = x.shape[-1]
    if cos.shape[-1] * 2 != d or sin.shape != cos.shape:
        raise ValueError(
            f"apply_rope: x's last dim {d} must be twice cos/sin's {cos.shape[-1]} "
            f"(cos {cos.shape}, sin {sin.shape})"
        )
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    c, s = cos.astype(acc), sin.astype(acc)
    if interleave:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(xf.shape)
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2 :]
        out = jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    return out.astype(x.dtype)
