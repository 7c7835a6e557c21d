"""DeepSeek V4 attention: sliding window, compressed sparse (CSA) and heavily compressed (HCA)
layers with attention sinks, each as one :func:`jax_dsa.sparse_mla` call.

Math and parameter names: transformers 5.24 ``DeepseekV4Attention`` (``q_a_proj``, ``q_a_norm``,
``q_b_proj``, ``kv_proj``, ``kv_norm``, ``o_a_proj``, ``o_b_proj``, ``sinks``, ``compressor``)
and the DeepSeek-V4 report §2.3::

    c_q  = RMSNorm(q_a_proj(x));   q_h = RoPE(rms(q_b_proj(c_q)_h))     (rms: no weight)
    kv   = RoPE(RMSNorm(kv_proj(x)))                                     (one K = V row per token)
    o_h  = sum_j softmax_j(scale * q_h . kv_j ; sink_h) kv_j             (j: window + compressed)
    o_h  = RoPE^{-1}(o_h)                                                (undo the keys' rotation)
    out  = o_b_proj([o_a_proj_g(o_{heads of group g})]_g)                (grouped output projection)

with RoPE on the last ``qk_rope_head_dim`` dims (interleaved), ``scale = head_dim**-0.5`` and the
sink ``exp(sinks[h])`` in each head's softmax denominator. RoPE: ``rope_theta`` on window-only
layers, ``compress_rope_parameters`` (YaRN) on compressed layers. The compressed rows come from
:class:`~jax_dsa.models.deepseek_v4.compressor.V4Compressor`; the slot lists from
:mod:`jax_dsa.models.deepseek_v4.slots` (``[window | compressed]``, valid prefix, ``topk_length``,
widths on the bucket ladder). Where the compressed part is every visible entry (HCA, and CSA in
dense mode) and there are more than :data:`MAX_LISTED_ENTRIES` of them, the layer lists the window
alone and attends to the compressed rows through :func:`jax_dsa.ops.sparse_dense_mla` (the same
softmax, no ``[S, S / m]`` list).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_dsa.models.deepseek_v4.compression_layout import compression_layout, query_segments
from jax_dsa.models.deepseek_v4.compressor import V4Compressor
from jax_dsa.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from jax_dsa.models.deepseek_v4.rope import apply_rope_tail
from jax_dsa.models.deepseek_v4.slots import assemble, slot_bucket, slot_width, window
from jax_dsa.nn.checks import check_positions
from jax_dsa.nn.layers import Linear, RMSNorm, param
from jax_dsa.nn.rope import rope_cos_sin
from jax_dsa.ops.indexer import V4_KL_REGISTRY, v4_indexer_kl_loss
from jax_dsa.ops.sparse_dense_mla import sparse_dense_mla
from jax_dsa.ops.sparse_mla import sparse_mla
from jax_dsa.sharding.constraints import (
    check_split, dividing, explicit_axes, out_spec, typed_spec, whole,
)

ATTENTION_MODES = ("sparse", "dense")
# Compressed entries per row up to which "every visible entry" is a slot list (one sparse_mla
# call); past it, dense_mla over the compressed rows (memory linear in S).
MAX_LISTED_ENTRIES = 2048


def unweighted_rms_norm(x, eps: float):
    """``x / sqrt(mean(x^2) + eps)`` over the last dim (statistics in float32 or wider), in x's
    dtype: transformers' ``DeepseekV4UnweightedRMSNorm`` (the per-head q norm)."""
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return x * inv.astype(x.dtype)


class GroupedLinear(nnx.Module):
    """Block-diagonal projection of ``n_groups`` equal slices of the input (transformers
    ``DeepseekV4GroupedLinear``): ``weight [n_groups * out_per_group, in_per_group]``; group ``g``
    maps ``x[..., g, :]`` with rows ``g * out_per_group .. (g + 1) * out_per_group - 1``."""

    def __init__(
        self, in_per_group: int, out_features: int, n_groups: int, *, axes: tuple[str, str],
        rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, init_std: float = 0.02,
    ):
        if out_features % n_groups:
            raise ValueError(
                f"GroupedLinear: out_features {out_features} not divisible by n_groups {n_groups}"
            )
        self.in_per_group, self.n_groups, self.dtype = in_per_group, n_groups, dtype
        self.weight = param(
            rngs, nnx.initializers.normal(init_std), (out_features, in_per_group), param_dtype, axes
        )

    def __call__(self, x):
        """``x [..., n_groups, in_per_group]`` -> ``[..., n_groups, out_per_group]``."""
        if x.shape[-2:] != (self.n_groups, self.in_per_group):
            raise ValueError(
                f"GroupedLinear: input must end in (n_groups, in_per_group) = "
                f"{(self.n_groups, self.in_per_group)}, got {x.shape}"
            )
        w = self.weight[...].astype(self.dtype)
        shape = (self.n_groups, w.shape[0] // self.n_groups, self.in_per_group)
        if not explicit_axes():
            return jnp.einsum("...gi,goi->...go", x.astype(self.dtype), w.reshape(shape))
        # Explicit mesh axes: x and the weight split their groups the same way (the weight's
        # row split where it divides the groups and x's leading dims do not use it, else none)
        spec = out_spec(typed_spec(x)[:-2], dividing(typed_spec(w)[0], self.n_groups), None)
        g = spec[-2]
        w = jnp.reshape(w if g is not None else whole(w, 0), shape, out_sharding=P(g, None, None))
        x = jax.sharding.reshard(x.astype(self.dtype), spec)
        return jnp.einsum("...gi,goi->...go", x, w, out_sharding=spec)


class DeepseekV4Attention(nnx.Module):
    """One DeepSeek V4 attention layer of type ``config.layer_types[layer_idx]``.

    Args:
      config: the model's :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config`.
      layer_idx: which layer (selects the layer type, hence compression and RoPE).
      rngs: parameter RNG.
      dtype: compute dtype (``float32`` default, ``bfloat16`` for speed); ``param_dtype``: storage
        dtype of the weights (sinks, position biases and norms stay float32).

    Parameter shapes (PyTorch ``[out, in]``), H = ``num_attention_heads``, D = ``head_dim``:
      ``q_a_proj [q_lora_rank, hidden]``, ``q_a_norm [q_lora_rank]``, ``q_b_proj [H * D,
      q_lora_rank]``, ``kv_proj [D, hidden]``, ``kv_norm [D]``, ``o_a_proj [o_groups *
      o_lora_rank, H * D / o_groups]``, ``o_b_proj [hidden, o_groups * o_lora_rank]``,
      ``sinks [H]`` (zeros at init), ``compressor`` (CSA / HCA layers, else ``None``).

    Raises:
      ValueError: ``layer_idx`` out of range.
    """

    def __init__(
        self, config: DeepseekV4Config, layer_idx: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        c = config
        if not 0 <= layer_idx < c.num_hidden_layers:
            raise ValueError(
                f"DeepseekV4Attention: layer_idx {layer_idx} not in [0, {c.num_hidden_layers})"
            )
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = c.layer_types[layer_idx]
        self.dtype = dtype
        h, d = c.num_attention_heads, c.head_dim
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=c.initializer_range)
        norm_kw = dict(eps=c.rms_norm_eps, rngs=rngs, param_dtype=param_dtype)
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, axes=("q_lora", "embed"), **kw)
        self.q_a_norm = RMSNorm(c.q_lora_rank, axes=("q_lora",), **norm_kw)
        self.q_b_proj = Linear(c.q_lora_rank, h * d, axes=("heads", "q_lora"), **kw)
        self.kv_proj = Linear(c.hidden_size, d, axes=("kv_lora", "embed"), **kw)
        self.kv_norm = RMSNorm(d, axes=("kv_lora",), **norm_kw)
        self.o_a_proj = GroupedLinear(
            h * d // c.o_groups, c.o_groups * c.o_lora_rank, c.o_groups,
            axes=("heads", "head_dim"), **kw,
        )
        self.o_b_proj = Linear(
            c.o_groups * c.o_lora_rank, c.hidden_size, axes=("embed", "heads"), **kw
        )
        self.sinks = param(rngs, nnx.initializers.zeros, (h,), jnp.float32, ("heads",))
        self.compressor = (
            None if self.layer_type == SLIDING
            else V4Compressor(c, self.layer_type, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        )

    def slot_width(self, seq_len: int, attention_mode: str = "sparse") -> int:
        """Slots per query of this layer at ``seq_len``
        (:func:`jax_dsa.models.deepseek_v4.slots.slot_width`)."""
        return slot_width(self.config, self.layer_type, seq_len, attention_mode)

    def __call__(
        self,
        x,
        positions=None,
        segment_ids=None,
        *,
        attention_mode: str = "sparse",
        implementation: str | tuple[str, ...] | None = None,
        compute_indexer_loss: bool = True,
        deterministic: bool | None = None,
    ):
        """Attention output and aux values.

        Args:
          x: ``[B, S, hidden_size]`` in any float dtype.
          positions: ``[B, S]`` integer positions counting 0, 1, 2, ... within each document of a
            row (default ``arange(S)``: one document). They drive RoPE, the window (never across a
            document start), the per-document compression and the visibility of compressed
            entries.
          segment_ids: optional ``[B, S]`` integer document ids of packed rows, used as the
            documents' labels in visibility checks (documents themselves are delimited by
            ``positions``: give positions that restart at 0 where a segment starts).
          attention_mode: ``"sparse"``: CSA layers attend to the indexer's top ``index_topk``
            entries; ``"dense"``: to every visible entry (the indexer's dense warm-up). Window-only
            and HCA layers are the same in both modes.
          implementation: passed to every op the layer calls (:func:`jax_dsa.sparse_mla`,
            ``indexer_topk``, ``v4_indexer_kl_loss``): a name, a sequence of names or ``None``;
            an op that lacks the named implementations uses its default order.
          compute_indexer_loss: compute the CSA indexer's KL loss (CSA layers only).
          deterministic: passed to every op the layer calls: ``True`` makes their backward
            passes sum in a fixed order (bitwise reproducible gradients), ``None`` (default)
            follows XLA's ``--xla_gpu_deterministic_ops`` (:mod:`jax_dsa.ops.determinism`).

        Returns:
          ``(out [B, S, hidden_size] in the compute dtype, aux)`` with ``aux["indices"]`` the
          ``[B, S, K]`` int32 slot lists (rows of ``[raw ; compressed]``, ``-1`` padded; ``K``
          from the bucket ladder; the window alone where the compressed rows go through
          ``sparse_dense_mla``, see the module docstring), ``aux["topk_length"]`` ``[B, S]``
          int32, ``aux["topk"]`` the CSA top-k into the compressed rows (``None`` elsewhere and
          in dense mode), and
          ``aux["indexer_loss"]`` a float32 scalar
          (:func:`jax_dsa.ops.indexer.v4_indexer_kl_loss`; dense form in dense mode,
          over the chosen entries in sparse mode) or ``None``.

        Raises:
          ValueError: unknown ``attention_mode`` or bad shapes.
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
        h, d, r = c.num_attention_heads, c.head_dim, c.qk_rope_head_dim

        cos, sin = rope_cos_sin(positions, c.rope_parameters_for(self.layer_type), r)
        c_q = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(c_q).reshape(b, s, h, d)
        q = unweighted_rms_norm(q, c.rms_norm_eps)
        q = apply_rope_tail(q, cos[:, :, None], sin[:, :, None])
        kv = apply_rope_tail(self.kv_norm(self.kv_proj(x)), cos, sin).astype(q.dtype)

        first_row, n_window = window(positions, c.sliding_window)
        width = self.slot_width(s, attention_mode)
        topk = index_qkw = layout = comp = None
        every_entry = self.layer_type != CSA or attention_mode == "dense"
        unlisted = (self.compressor is not None and every_entry
                    and s // self.compressor.ratio > MAX_LISTED_ENTRIES)
        no_entries = self.compressor is not None and s < self.compressor.ratio
        if self.compressor is None or no_entries:  # rows too short to compress: window only
            indices, lengths = assemble(first_row, n_window, width)
            kv_all = kv
        else:
            layout = compression_layout(positions, self.compressor.ratio, segment_ids)
            comp = self.compressor(x, layout).astype(q.dtype)
            kv_all = jnp.concatenate([whole(kv, 1), comp], axis=1)  # whole on Explicit axes
            if self.layer_type == CSA:
                indexer = self.compressor.indexer
                index_qkw = indexer(x, c_q, positions, layout)
            if self.layer_type == CSA and attention_mode == "sparse":
                topk = indexer.topk(*index_qkw, positions, layout, segment_ids,
                                    implementation=implementation)
                indices, lengths = assemble(
                    first_row, n_window, width, compressed=topk, compressed_offset=s
                )
            elif unlisted:  # the window listed, every visible entry through dense_mla
                indices, lengths = assemble(first_row, n_window,
                                            slot_bucket(min(c.sliding_window, s)))
            else:
                indices, lengths = assemble(
                    first_row, n_window, width, compressed_first=layout.first,
                    compressed_count=layout.count, compressed_offset=s,
                )

        sinks = self.sinks[...].astype(jnp.float32)
        if unlisted:
            o, lse = sparse_dense_mla(
                q, kv, indices, comp, sm_scale=c.softmax_scale, d_v=d, q_positions=positions,
                kv_dense_positions=layout.positions,
                q_segment_ids=query_segments(positions, segment_ids),
                kv_dense_segment_ids=layout.segment_ids, attn_sink=sinks, topk_length=lengths,
                implementation=implementation, deterministic=deterministic,
            )
        else:
            o, lse = sparse_mla(
                q, kv_all, indices, sm_scale=c.softmax_scale, d_v=d, attn_sink=sinks,
                topk_length=lengths, implementation=implementation, deterministic=deterministic,
            )
        o = apply_rope_tail(o, cos[:, :, None], -sin[:, :, None])
        sharding = None
        if explicit_axes():  # the groups take the heads' split where it divides them
            lead = typed_spec(o)
            sharding = out_spec(lead[:2], dividing(lead[2], c.o_groups), None)
        grouped = jnp.reshape(o, (b, s, c.o_groups, h * d // c.o_groups), out_sharding=sharding)
        out = self.o_b_proj(self.o_a_proj(grouped).reshape(b, s, c.o_groups * c.o_lora_rank))

        loss = None
        if no_entries and self.layer_type == CSA and compute_indexer_loss:
            loss = jnp.zeros((), jnp.float32)  # no compressed entry, no row to score
        if index_qkw is not None and compute_indexer_loss:
            attention_lse = jnp.logaddexp(jax.lax.stop_gradient(lse), sinks[None, None, :])
            loss = v4_indexer_kl_loss(
                *index_qkw, q, comp, attention_lse, sm_scale=c.softmax_scale,
                q_positions=positions, kv_positions=layout.positions,
                q_segment_ids=query_segments(positions, segment_ids),
                kv_segment_ids=layout.segment_ids, indices=topk,
                implementation=V4_KL_REGISTRY.restrict(implementation),
                deterministic=deterministic,
            ).astype(jnp.float32)
        aux = {"indices": indices, "topk_length": lengths, "topk": topk, "indexer_loss": loss}
        return out, aux
