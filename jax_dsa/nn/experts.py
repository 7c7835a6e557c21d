"""The routed experts of both families' MoE blocks, stacked and run dropless, and the
non-trainable :class:`Buffer` their routers keep (correction biases, hash tables).

For a token ``x`` routed to experts ``idx`` with gate values ``w`` (the router's job)::

    out = sum_j w_j * expert_{idx_j}(x),
    expert_e(x) = down_proj[e] @ (silu(gate_proj[e] @ x) * up_proj[e] @ x)

(DeepSeek V4 clips the pre-activations: :attr:`Experts.swiglu_limit`). The (token, expert) pairs
are sorted by expert and pushed through :func:`jax.lax.ragged_dot`, so the cost is that of the
chosen experts only and no token is ever dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_dsa.nn.layers import param
from jax_dsa.sharding.constraints import explicit_axes, typed_spec

ROUTER_NORM_EPS = 1e-20  # transformers adds this to the sum of the chosen gate values



class Buffer(nnx.Variable):
    """Non-trainable state that checkpoints carry (e.g. the router's correction bias): not an
    ``nnx.Param``, so optimizers built over ``nnx.Param`` leave it alone."""


class Experts(nnx.Module):
    """The routed experts (HF ``mlp.experts``), stacked: ``gate_proj``, ``up_proj``
    ``[n_routed_experts, moe_intermediate_size, hidden_size]`` and ``down_proj [n_routed_experts,
    hidden_size, moe_intermediate_size]`` (per expert the PyTorch ``[out, in]`` layout of the
    checkpoints' ``experts.{e}.{gate,up,down}_proj.weight``).

    Args:
      config: a family's config (:class:`~jax_dsa.models.glm.config.DSAConfig`,
        :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config`): ``n_routed_experts``,
        ``moe_intermediate_size``, ``hidden_size``, ``initializer_range``.
      rngs: parameter RNG; ``dtype``: compute dtype; ``param_dtype``: storage dtype.
    """

    # DeepSeek V4 clips the pre-activations (jax_dsa.models.deepseek_v4.moe.V4Experts)
    swiglu_limit: float | None = None

    def __init__(self, config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        c = config
        self.config = config
        self.dtype = dtype
        e, i, h = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        init = nnx.initializers.normal(c.initializer_range)
        self.gate_proj = param(rngs, init, (e, i, h), param_dtype, ("experts", "mlp", "embed"))
        self.up_proj = param(rngs, init, (e, i, h), param_dtype, ("experts", "mlp", "embed"))
        self.down_proj = param(rngs, init, (e, h, i), param_dtype, ("experts", "embed", "mlp"))

    def __call__(self, x, topk_weights, topk_indices):
        """``x [T, hidden]``, ``topk_weights``/``topk_indices [T, k]`` -> ``[T, hidden]`` (compute
        dtype): ``sum_j topk_weights[t, j] * expert_{topk_indices[t, j]}(x[t])``."""
        weights = tuple(p[...].astype(self.dtype) for p in
                        (self.gate_proj, self.up_proj, self.down_proj))
        mix = functools.partial(_mix, n_experts=self.config.n_routed_experts,
                                limit=self.swiglu_limit)
        if not explicit_axes():
            return mix(x.astype(self.dtype), topk_weights, topk_indices, *weights)
        # Explicit mesh axes: each token shard routes its own tokens through every expert (the
        # sort and bincount run on local tokens); a split of the experts' inner dim is summed.
        tok = typed_spec(x)[0]
        inner = typed_spec(weights[0])[1]
        specs = (P(tok, None),) * 3 + (P(None, inner, None),) * 2 + (P(None, None, inner),)
        args = tuple(jax.sharding.reshard(a, sp) for a, sp in
                     zip((x.astype(self.dtype), topk_weights, topk_indices, *weights), specs))

        def local(*a):
            y = mix(*a)
            return y if inner is None else jax.lax.psum(y, inner)

        return jax.shard_map(local, in_specs=specs, out_specs=P(tok, None), check_vma=False)(
            *args)


def _mix(x, topk_weights, topk_indices, gate_proj, up_proj, down_proj, *, n_experts,
         limit=None):
    """The routed experts on one set of tokens (weights in the PyTorch ``[E, out, in]`` layout);
    ``limit``: clip the gate pre-activation above at ``limit`` and the up one to ``[-limit,
    limit]`` (``None``: no clip)."""
    t, k = topk_indices.shape
    flat = topk_indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    token = order // k
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    xs = x[token]
    w_gate = jnp.swapaxes(gate_proj, 1, 2)  # [E, H, I]
    w_up = jnp.swapaxes(up_proj, 1, 2)
    w_down = jnp.swapaxes(down_proj, 1, 2)  # [E, I, H]
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    h = jax.nn.silu(gate) * up
    y = jax.lax.ragged_dot(h, w_down, group_sizes)
    y = y * topk_weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((t, x.shape[-1]), y.dtype).at[token].add(y)


__all__ = ["Buffer", "Experts", "ROUTER_NORM_EPS"]
