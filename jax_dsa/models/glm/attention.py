"""DSA attention: Multi-head Latent Attention (MLA) in absorbed form over sparse slot lists.

Parameters are kept in the Hugging Face (un-absorbed) layout and names of transformers'
``DeepseekV32Attention`` / ``GlmMoeDsaAttention`` (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, ``indexer``); the
absorbed, MQA form that :func:`jax_dsa.sparse_mla` takes is computed in the layer
(DeepSeek-V3.2 paper §1 and App. A; DeepSeek-V3.2-Exp ``inference/model.py``, ``MLA`` decode
path)::

    c_q   = RMSNorm(q_a_proj(x));  [q_nope | q_rope]_h = q_b_proj(c_q)_h;   RoPE(q_rope)
    [c_kv | k_rope] = kv_a_proj_with_mqa(x);  c_kv = RMSNorm(c_kv);           RoPE(k_rope)
    kv_b_proj.weight -> per head W_UK_h [qk_nope, kv_lora], W_UV_h [v_head, kv_lora]
    q_h   = [W_UK_h^T q_nope_h ; q_rope_h]          (d_qk = kv_lora_rank + qk_rope_head_dim)
    kv_s  = [c_kv_s ; k_rope_s]                     (one row per token, shared by the heads)
    o_h   = W_UV_h sparse_mla(q, kv, indices, sm_scale, d_v=kv_lora_rank)_h
            (dense mode: dense_mla(q, kv, sm_scale, d_v, positions, segment ids))
    out   = o_proj([o_h]_h)

which equals un-absorbed attention with ``k_nope_h = W_UK_h c_kv``, ``v_h = W_UV_h c_kv`` and the
un-absorbed softmax scale (``config.softmax_scale``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.models.glm.indexer import Indexer
from jax_dsa.nn.checks import check_positions
from jax_dsa.nn.layers import Linear, RMSNorm
from jax_dsa.nn.rope import apply_rope, rope_cos_sin
from jax_dsa.ops.dense_mla import REGISTRY as DENSE_REGISTRY
from jax_dsa.ops.dense_mla import dense_mla
from jax_dsa.ops.indexer import KL_REGISTRY, indexer_kl_loss
from jax_dsa.ops.sparse_mla import sparse_mla
from jax_dsa.sharding import constrain
from jax_dsa.sharding.constraints import check_split, matching

ATTENTION_MODES = ("sparse", "dense")
# q_a_layernorm / kv_a_layernorm use the RMSNorm default eps, not config.rms_norm_eps
# (DeepSeek-V3.2 reference ``MLA.q_norm``/``kv_norm``; transformers ``DeepseekV3Attention``).
LATENT_NORM_EPS = 1e-6


class DSAAttention(nnx.Module):
    """One DSA attention layer (MLA + lightning indexer, or MLA reusing shared top-k).

    Args:
      config: the model's :class:`~jax_dsa.configs.DSAConfig`.
      layer_idx: which layer; ``config.indexer_types[layer_idx]`` decides whether it owns an
        :class:`~jax_dsa.models.glm.indexer.Indexer` (``"full"``) or reuses the previous full
        layer's top-k (``"shared"``, GLM-5.2 IndexShare; ``self.indexer`` is ``None``).
      rngs: parameter RNG.
      dtype: compute dtype (``float32`` default; ``bfloat16`` for speed); ``param_dtype``:
        storage dtype of the weights.

    Parameter shapes (PyTorch ``[out, in]``), H = ``num_attention_heads``:
      ``q_a_proj [q_lora_rank, hidden]``, ``q_a_layernorm [q_lora_rank]``,
      ``q_b_proj [H * (qk_nope + qk_rope), q_lora_rank]``,
      ``kv_a_proj_with_mqa [kv_lora_rank + qk_rope, hidden]``, ``kv_a_layernorm [kv_lora_rank]``,
      ``kv_b_proj [H * (qk_nope + v_head), kv_lora_rank]``, ``o_proj [hidden, H * v_head]``.
    """

    def __init__(
        self, config: DSAConfig, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        if not 0 <= layer_idx < c.num_hidden_layers:
            raise ValueError(
                f"DSAAttention: layer_idx {layer_idx} not in [0, {c.num_hidden_layers})"
            )
        self.config = config
        self.layer_idx = layer_idx
        self.dtype = dtype
        h, std = c.num_attention_heads, c.initializer_range
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=std)
        norm_kw = dict(eps=LATENT_NORM_EPS, rngs=rngs, param_dtype=param_dtype)
        bias = c.attention_bias
        self.q_a_proj = Linear(
            c.hidden_size, c.q_lora_rank, axes=("q_lora", "embed"), use_bias=bias, **kw
        )
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, axes=("q_lora",), **norm_kw)
        self.q_b_proj = Linear(c.q_lora_rank, h * c.qk_head_dim, axes=("heads", "q_lora"), **kw)
        self.kv_a_proj_with_mqa = Linear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, axes=("kv_lora", "embed"),
            use_bias=bias, **kw,
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, axes=("kv_lora",), **norm_kw)
        self.kv_b_proj = Linear(
            c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), axes=("heads", "kv_lora"),
            **kw,
        )
        self.o_proj = Linear(
            h * c.v_head_dim, c.hidden_size, axes=("embed", "heads"), use_bias=bias, **kw
        )
        full = c.has_indexer(layer_idx)
        self.indexer = (
            Indexer(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype) if full else None
        )

    def absorbed_qkv(self, x, cos, sin):
        """The absorbed query ``q [B, S, H, d_qk]``, latent rows ``kv [B, S, d_qk]`` (compute
        dtype), the value up-projection ``w_uv [H, v_head_dim, kv_lora_rank]`` and ``c_q``."""
        c = self.config
        b, s = x.shape[:2]
        h, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        c_q = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(c_q).reshape(b, s, h, nope + rope)
        q_nope = q[..., :nope]
        q_rope = apply_rope(
            q[..., nope:], cos[:, :, None], sin[:, :, None], interleave=c.rope_interleave
        )
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(ckv[..., : c.kv_lora_rank])
        k_rope = apply_rope(ckv[..., c.kv_lora_rank :], cos, sin, interleave=c.rope_interleave)
        w = self.kv_b_proj.weight[...].astype(self.dtype)
        w = w.reshape(h, nope + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_lat = jnp.einsum("bshn,hnc->bshc", q_nope, matching(w_uk, 0, q_nope, 2))
        q_abs = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)
        kv = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1).astype(q_abs.dtype)
        return q_abs, kv, w_uv, c_q

    def __call__(
        self,
        x,
        positions=None,
        segment_ids=None,
        *,
        attention_mode: str = "sparse",
        indices=None,
        implementation: str | tuple[str, ...] | None = None,
        compute_indexer_loss: bool = True,
        deterministic: bool | None = None,
    ):
        """Attention output and aux values.

        Args:
          x: ``[B, S, hidden_size]`` (batch, sequence, embed) in any float dtype.
          positions: ``[B, S]`` integer per-document positions (default ``arange(S)`` per row):
            drive RoPE and causality (key ``s`` visible to query ``t`` iff
            ``positions[s] <= positions[t]`` within the same segment).
          segment_ids: optional ``[B, S]`` integer document ids for packed rows.
          attention_mode: ``"sparse"``: attend to the indexer's top-k (or ``indices``) through
            :func:`jax_dsa.sparse_mla`; ``"dense"``: attend to every visible key (dense warm-up)
            through :func:`jax_dsa.dense_mla`, which takes the positions and segment ids and
            builds no slot list.
          indices: optional ``[B, S, K]`` int slot lists to attend to instead, in either mode
            (the previous full layer's top-k on a ``"shared"`` layer, or hand-made ones);
            ``-1`` = invalid slot.
          implementation: passed to every op the layer calls (:func:`jax_dsa.sparse_mla`,
            :func:`jax_dsa.dense_mla`, ``indexer_topk``, ``indexer_kl_loss``): a name, a
            sequence of names or ``None``; an op that lacks the named implementations uses its
            default order.
          compute_indexer_loss: compute the indexer KL loss (full layers only).
          deterministic: passed to every op the layer calls: ``True`` makes their backward
            passes sum in a fixed order (bitwise reproducible gradients), ``None`` (default)
            follows XLA's ``--xla_gpu_deterministic_ops`` (:mod:`jax_dsa.ops.determinism`).

        Returns:
          ``(out [B, S, hidden_size] in the compute dtype, aux)`` with ``aux["indices"]`` the
          ``[B, S, K]`` int32 slots used (``None`` in dense mode without ``indices``: every
          visible key), and ``aux["indexer_loss"]`` a float32 scalar
          (:func:`jax_dsa.ops.indexer.indexer_kl_loss` against this layer's own absorbed q and
          kv: dense form in dense mode, sparse form over the used slots in sparse mode) or
          ``None`` on shared layers / when not computed.

        Raises:
          ValueError: unknown ``attention_mode``, bad shapes, or a ``"shared"`` layer in sparse
            mode without ``indices``.
        """
        c = self.config
        if attention_mode not in ATTENTION_MODES:
            raise ValueError(
                f"attention_mode must be one of {ATTENTION_MODES}, got {attention_mode!r}"
            )
        if x.ndim != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be [B, S, hidden_size={c.hidden_size}], got shape {x.shape}")
        check_split(c.num_attention_heads, "heads", "num_attention_heads")
        b, s = x.shape[:2]
        positions, segment_ids = check_positions(positions, segment_ids, b, s)
        if indices is not None and (indices.ndim != 3 or indices.shape[:2] != (b, s)):
            raise ValueError(
                f"indices must be [B, S, K] with (B, S) = {(b, s)}, got shape {indices.shape}"
            )
        if attention_mode == "sparse" and indices is None and self.indexer is None:
            raise ValueError(
                f"layer {self.layer_idx} is a 'shared' indexer layer: in sparse mode it needs the "
                "previous full layer's top-k as `indices`"
            )

        cos, sin = rope_cos_sin(positions, c.rope_parameters, c.qk_rope_head_dim)
        q, kv, w_uv, c_q = self.absorbed_qkv(x, cos, sin)
        q = constrain(q, ("batch", "sequence", "heads", None))
        kv = constrain(kv, ("batch", "sequence", None))  # split by token; the op gathers it
        index_qkw = self.indexer(x, c_q, cos, sin) if self.indexer is not None else None

        index_scores = None  # the slots' index scores, when the top-k gives them
        if indices is None and attention_mode == "dense":
            # every visible key, from positions and segment ids: no [S, S] slot list
            o_lat, lse = dense_mla(
                q, kv, sm_scale=c.softmax_scale, d_v=c.d_v, q_positions=positions,
                kv_positions=positions, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                implementation=DENSE_REGISTRY.restrict(implementation),
                deterministic=deterministic,
            )
        else:
            own = indices is None  # slots from this layer's indexer: all visible
            if own:
                # the KL loss takes the slots' scores from the top-k (unless they are fp8 ones)
                with_scores = compute_indexer_loss and self.indexer.qk_dtype is None
                indices = self.indexer.topk(*index_qkw, positions, segment_ids,
                                            implementation=implementation,
                                            return_scores=with_scores)
                if with_scores:  # (the KL loss then runs no score kernel on "cuda")
                    indices, index_scores = indices
            indices = indices.astype(jnp.int32)
            o_lat, lse = sparse_mla(
                q, kv, indices, sm_scale=c.softmax_scale, d_v=c.d_v, implementation=implementation,
                deterministic=deterministic,
            )
            if not own:  # given slots may hold keys the KL's support leaves out
                lse = None
        o = jnp.einsum("bshc,hvc->bshv", o_lat, matching(w_uv, 0, o_lat, 2))
        o = o.reshape(b, s, c.num_attention_heads * c.v_head_dim)
        out = self.o_proj(o)

        loss = None
        if index_qkw is not None and compute_indexer_loss:
            loss = indexer_kl_loss(
                *index_qkw, q, kv, sm_scale=c.softmax_scale, q_positions=positions,
                kv_positions=positions, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                indices=None if attention_mode == "dense" else indices,
                # the attention's own denominators over the same support: the target is not
                # recomputed from a softmax ("cuda": the attention kernel's target mode)
                attention_lse=lse, index_scores=index_scores,
                implementation=KL_REGISTRY.restrict(implementation),
                deterministic=deterministic,
            ).astype(jnp.float32)
        return out, {"indices": indices, "indexer_loss": loss}
