"""SwiGLU feed-forward block (transformers ``DeepseekV3MLP``: ``gate_proj``, ``up_proj``,
``down_proj``; Shazeer, 2020, arXiv:2002.05202)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa.nn.layers import Linear
from jax_dsa.sharding import constrain


class MLP(nnx.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; weights ``gate_proj``/``up_proj
    [intermediate, hidden]``, ``down_proj [hidden, intermediate]``."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32, init_std: float = 0.02,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, init_std=init_std)
        self.gate_proj = Linear(hidden_size, intermediate_size, axes=("mlp", "embed"), **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, axes=("mlp", "embed"), **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, axes=("embed", "mlp"), **kw)

    def __call__(self, x):
        """``x [..., hidden]`` -> ``[..., hidden]`` in the compute dtype."""
        hidden = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        if hidden.ndim == 3:  # [B, S, intermediate]: split like the mlp weights
            hidden = constrain(hidden, ("batch", "sequence", "mlp"))
        return self.down_proj(hidden)
