"""The lightning indexer module (DSA): projections, partial RoPE and head weights.

Math and parameter names: DeepSeek-V3.2-Exp ``inference/model.py`` (``Indexer``) and
transformers ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``:

* ``q = wq_b(c_q)`` -> ``[index_n_heads, index_head_dim]``; ``k = k_norm(wk(x))`` (LayerNorm
  with bias, eps 1e-6), one key per token shared by the index heads;
* RoPE on the **first** ``qk_rope_head_dim`` dims of q and k (layout ``[rope | nope]``),
  interleaved for GLM-5 (``indexer_rope_interleave=True``), half-split for DeepSeek V3.2;
* ``weights = weights_proj(x) * index_n_heads**-0.5 * index_head_dim**-0.5`` (float32);
* score ``I[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s])``
  (:func:`jax_dsa.ops.indexer.indexer_topk`).

V3.2's Hadamard rotation of q and k is orthogonal (dot products unchanged), so it is not applied
here. Its FP8 quantization of the top-k's scores is an option (``qk_dtype="float8_e4m3fn"``, see
:func:`jax_dsa.ops.indexer.indexer_topk`), off by default; the KL loss always uses the
unquantized q and k.

The inputs ``x`` and ``c_q`` are wrapped in ``stop_gradient``: the indexer is trained only by the
KL loss, and the language-model loss never reaches it (paper §2.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.nn.layers import LayerNorm, Linear
from jax_dsa.nn.rope import apply_rope
from jax_dsa.ops.indexer import TOPK_REGISTRY, indexer_topk
from jax_dsa.ops.indexer.topk.op import check_qk_dtype
from jax_dsa.sharding import constrain
from jax_dsa.sharding.constraints import check_split

K_NORM_EPS = 1e-6


class Indexer(nnx.Module):
    """DSA lightning indexer of one ``"full"`` layer.

    Parameters (HF names, PyTorch ``[out, in]`` layout): ``wq_b [index_n_heads *
    index_head_dim, q_lora_rank]``, ``wk [index_head_dim, hidden_size]``, ``k_norm.weight`` /
    ``k_norm.bias [index_head_dim]``, ``weights_proj [index_n_heads, hidden_size]`` (float32).

    ``qk_dtype``: ``None`` or ``"float8_e4m3fn"``, the scores the top-k selects by (see
    :func:`jax_dsa.ops.indexer.indexer_topk`); a static attribute, settable after construction
    (``layer.indexer.qk_dtype = "float8_e4m3fn"``). Raises ``ValueError`` for other values.
    """

    def __init__(
        self, config: DSAConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
        qk_dtype=None,
    ):
        c = config
        check_qk_dtype("Indexer", qk_dtype)
        self.config = config
        self.dtype = dtype
        self.qk_dtype = qk_dtype
        std = c.initializer_range
        self.wq_b = Linear(
            c.q_lora_rank, c.index_n_heads * c.index_head_dim, axes=("index_heads", "q_lora"),
            rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=std,
        )
        self.wk = Linear(
            c.hidden_size, c.index_head_dim, axes=("index_head_dim", "embed"), rngs=rngs,
            dtype=dtype, param_dtype=param_dtype, init_std=std,
        )
        self.k_norm = LayerNorm(
            c.index_head_dim, eps=K_NORM_EPS, axes=("index_head_dim",), rngs=rngs
        )
        # Kept in float32 as in the reference (excluded from FP8 / low precision there too).
        self.weights_proj = Linear(
            c.hidden_size, c.index_n_heads, axes=("index_heads", "embed"), rngs=rngs,
            dtype=jnp.float32, param_dtype=jnp.float32, init_std=std,
        )

    def __call__(self, x, c_q, cos, sin):
        """Indexer queries, keys and head weights.

        Args:
          x: ``[B, S, hidden_size]`` layer input (batch, sequence, embed).
          c_q: ``[B, S, q_lora_rank]`` the RMSNorm'd q latent of the same layer.
          cos, sin: ``[B, S, qk_rope_head_dim // 2]`` from :func:`jax_dsa.nn.rope.rope_cos_sin`.

        Returns:
          ``q [B, S, index_n_heads, index_head_dim]`` and ``k [B, S, index_head_dim]`` in the
          compute dtype, ``weights [B, S, index_n_heads]`` float32 with the scale folded in.
        """
        c = self.config
        # on Auto axes the partitioner reshards the fused wq_b output itself
        check_split(c.index_n_heads, "index_heads", "index_n_heads",
                    axis_types=(AxisType.Explicit,))
        x = jax.lax.stop_gradient(x)
        c_q = jax.lax.stop_gradient(c_q)
        b, s = x.shape[:2]
        r = c.qk_rope_head_dim
        q = self.wq_b(c_q).reshape(b, s, c.index_n_heads, c.index_head_dim)
        interleave = c.indexer_rope_interleave
        q_rot = apply_rope(q[..., :r], cos[:, :, None], sin[:, :, None], interleave=interleave)
        q = jnp.concatenate([q_rot, q[..., r:]], axis=-1)
        k = self.k_norm(self.wk(x))
        k_rot = apply_rope(k[..., :r], cos, sin, interleave=interleave)
        k = jnp.concatenate([k_rot, k[..., r:]], axis=-1)
        weights = self.weights_proj(x.astype(jnp.float32)) * c.indexer_weight_scale
        q = constrain(q, ("batch", "sequence", "index_heads", None))
        k = constrain(k, ("batch", "sequence", None))
        weights = constrain(weights, ("batch", "sequence", "index_heads"))
        return q, k, weights

    def topk(self, q, k, weights, positions, segment_ids=None, *, implementation=None,
             return_scores=False):
        """Top-``min(index_topk, S)`` visible keys per query: ``[B, S, K]`` int32, ``-1`` padded
        (with ``return_scores``: and their ``[B, S, K]`` float32 scores, ``-inf`` on ``-1``).

        See :func:`jax_dsa.ops.indexer.indexer_topk` for ordering and ties. ``implementation``:
        the layer's choice; the names :func:`~jax_dsa.ops.indexer.indexer_topk` lacks are
        dropped (none left: its default order).
        """
        topk = min(self.config.index_topk, k.shape[-2])
        return indexer_topk(
            q, k, weights, topk=topk, q_positions=positions, kv_positions=positions,
            q_segment_ids=segment_ids, kv_segment_ids=segment_ids, qk_dtype=self.qk_dtype,
            return_scores=return_scores, implementation=TOPK_REGISTRY.restrict(implementation),
        )
