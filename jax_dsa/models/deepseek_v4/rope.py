"""DeepSeek V4's partial RoPE: interleaved pairs on the **last** ``qk_rope_head_dim`` dims.

V4 lays each head out as ``[nope | rope]`` and rotates adjacent pairs ``(x[2i], x[2i+1])`` of the
trailing slice (deepseek-ai ``inference/model.py``: ``x[..., -rd:]``; transformers 5.24
``deepseek_v4.apply_rotary_pos_emb``). The inverse rotation (``-sin``) undoes it on the attention
output, whose rope slice picked up the keys' rotation because K = V.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_dsa.nn.rope import apply_rope


def apply_rope_tail(x, cos, sin):
    """Rotate the last ``2 * cos.shape[-1]`` dims of ``x`` (interleaved pairs); keep the rest.

    Args:
      x: ``[..., d]`` float array.
      cos, sin: ``[..., r // 2]`` broadcastable against ``x[..., : r // 2]``; pass ``-sin`` for
        the inverse rotation.

    Returns:
      ``x``'s shape and dtype.

    Raises:
      ValueError: the rotated width exceeds ``d``.
    """
    r = 2 * cos.shape[-1]
    if r > x.shape[-1]:
        raise ValueError(f"apply_rope_tail: rope width {r} exceeds x's last dim {x.shape[-1]}")
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin, interleave=True)
    rot = apply_rope(x[..., -r:], cos, sin, interleave=True)
    return jnp.concatenate([x[..., :-r], rot.astype(x.dtype)], axis=-1)
