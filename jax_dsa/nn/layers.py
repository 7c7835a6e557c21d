"""Basic NNX layers kept in the Hugging Face parameter layout: Linear, RMSNorm, LayerNorm, Embed.

Weights are stored exactly as the PyTorch checkpoints hold them (``Linear.weight`` is
``[out_features, in_features]``), so loading a checkpoint is a renaming of keys. Every parameter
carries logical axis names (``out_sharding`` metadata, not applied eagerly) for later sharding
rules; see :data:`LOGICAL_AXES`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa.sharding.constraints import explicit_axes, out_spec, typed_spec

# Logical axis names used on parameters (and, in docstrings, on activations).
LOGICAL_AXES = (
    "batch", "sequence", "embed", "vocab", "heads", "q_lora", "kv_lora", "mlp",
    "index_heads", "index_head_dim", "experts",
)


def param(rngs: nnx.Rngs, init, shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
    """An ``nnx.Param`` with logical axis names recorded as (lazy) ``out_sharding`` metadata."""
    if len(axes) != len(shape):
        raise ValueError(f"param: {len(axes)} axis names {axes} for shape {shape}")
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


class Linear(nnx.Module):
    """``y = x @ weight.T (+ bias)`` with ``weight [out_features, in_features]`` (PyTorch layout).

    Args:
      in_features, out_features: sizes.
      axes: logical names of ``(out, in)``.
      use_bias: add a ``bias [out_features]``.
      dtype: compute dtype (inputs and weights are cast to it); ``param_dtype`` storage dtype.
      init_std: standard deviation of the normal initializer (HF ``initializer_range``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str, str],
        rngs: nnx.Rngs,
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        init_std: float = 0.02,
    ):
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.weight = param(
            rngs, nnx.initializers.normal(init_std), (out_features, in_features), param_dtype, axes
        )
        self.bias = (
            param(rngs, nnx.initializers.zeros, (out_features,), param_dtype, axes[:1])
            if use_bias
            else None
        )

    def __call__(self, x):
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear: input's last dim {x.shape[-1]} != in_features {self.in_features}"
            )
        w = self.weight[...]
        # Explicit mesh axes: the result keeps x's leading shardings and the weight's output
        # one (a contraction over a split dim is reduced); Auto axes leave it to the partitioner.
        sharding = out_spec(typed_spec(x)[:-1], typed_spec(w)[0]) if explicit_axes() else None
        y = jnp.einsum("...i,oi->...o", x.astype(self.dtype), w.astype(self.dtype),
                       out_sharding=sharding)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32, cast back to ``x``'s dtype
    (transformers ``DeepseekV3RMSNorm``; Zhang & Sennrich, 2019, arXiv:1910.07467)."""

    def __init__(
        self, dim: int, *, eps: float, axes: tuple[str], rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        self.eps = float(eps)
        self.weight = param(rngs, nnx.initializers.ones, (dim,), param_dtype, axes)

    def __call__(self, x):
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(xf.dtype) * xf).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with ``weight`` and ``bias`` in float32 (the indexer's ``k_norm``, eps 1e-6 in
    the DeepSeek-V3.2 reference and transformers)."""

    def __init__(
        self, dim: int, *, eps: float, axes: tuple[str], rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        self.eps = float(eps)
        self.weight = param(rngs, nnx.initializers.ones, (dim,), param_dtype, axes)
        self.bias = param(rngs, nnx.initializers.zeros, (dim,), param_dtype, axes)

    def __call__(self, x):
        xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(xf.dtype) + self.bias[...].astype(xf.dtype)
        return y.astype(x.dtype)


class Embed(nnx.Module):
    """Token embedding ``weight [vocab_size, hidden_size]`` (HF ``embed_tokens.weight``)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32, init_std: float = 0.02,
    ):
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.weight = param(
            rngs, nnx.initializers.normal(init_std), (vocab_size, hidden_size), param_dtype,
            ("vocab", "embed"),
        )

    def __call__(self, input_ids):
        w = self.weight[...]
        if explicit_axes():  # the rows follow the ids' sharding (JAX does not choose one)
            return w.at[input_ids].get(mode="fill", out_sharding=out_spec(
                typed_spec(input_ids), None)).astype(self.dtype)
        return jnp.take(w, input_ids, axis=0).astype(self.dtype)
