"""Mixture-of-experts feed-forward block of GLM-5 / DeepSeek V3.2 (sigmoid router, shared expert).

Math and parameter names: transformers ``DeepseekV3TopkRouter`` / ``GlmMoeDsaTopkRouter``,
``GlmMoeDsaExperts`` and ``GlmMoeDsaMoE``; DeepSeek-V3 technical report (arXiv:2412.19437) §2.1.2
(sigmoid affinities, auxiliary-loss-free balancing bias used for the choice only, normalised
gate values) and DeepSeek-V3 ``inference/model.py`` (``Gate``: node-limited group routing).

For a token ``x`` (``E = n_routed_experts`` experts in ``n_group`` equal groups)::

    s      = sigmoid(gate.weight @ x)                       (float32, [E])
    c      = s + gate.e_score_correction_bias              (choice scores only)
    group  = sum of the top 2 of c within each group;  keep the topk_group best groups
    idx    = top num_experts_per_tok of c over the kept groups' experts
    w      = s[idx] / (sum s[idx] + 1e-20) if norm_topk_prob else s[idx]
    w      = w * routed_scaling_factor
    out    = sum_j w_j * expert_{idx_j}(x) + shared_experts(x)

with ``expert_e(x) = down_proj[e] @ (silu(gate_proj[e] @ x) * up_proj[e] @ x)`` and
``shared_experts`` a SwiGLU MLP of width ``moe_intermediate_size * n_shared_experts``.

The routed experts run "dropless" (:class:`jax_dsa.nn.experts.Experts`, shared with DeepSeek
V4): the (token, expert) pairs are sorted by expert and pushed through
:func:`jax_dsa.ops.grouped_matmul`, so the cost is that of the chosen experts only and no token is
ever dropped. There is no load-balancing loss; the correction bias (a non-trainable
:class:`~jax_dsa.nn.experts.Buffer`) moves by DeepSeek-V3's auxiliary-loss-free rule outside the
gradient (:func:`jax_dsa.nn.experts.update_router_biases`, from the loads the block returns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.nn.experts import ROUTER_NORM_EPS, Buffer, Experts
from jax_dsa.nn.layers import param
from jax_dsa.nn.mlp import MLP


class TopkRouter(nnx.Module):
    """The router (HF ``mlp.gate``): ``weight [n_routed_experts, hidden_size]`` float32 (a
    ``Param``) and ``e_score_correction_bias [n_routed_experts]`` float32 (a
    :class:`~jax_dsa.nn.experts.Buffer`)."""

    def __init__(self, config: DSAConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.weight = param(
            rngs, nnx.initializers.normal(c.initializer_range), (c.n_routed_experts, c.hidden_size),
            jnp.float32, (None, "embed"),  # every token scores every expert: whole
        )
        self.e_score_correction_bias = Buffer(
            jnp.zeros((c.n_routed_experts,), jnp.float32), out_sharding=(None,),
            eager_sharding=False,
        )

    def __call__(self, x):
        """Route tokens.

        Args:
          x: ``[T, hidden_size]`` tokens (any float dtype; routing runs in float32).

        Returns:
          ``(topk_weights [T, num_experts_per_tok] float32, topk_indices [T,
          num_experts_per_tok] int32)``: the gate values (normalised and scaled) and the chosen
          experts. Neither the choice nor the correction bias carries a gradient; the gate values
          do (to ``weight`` and ``x``).
        """
        c = self.config
        t = x.shape[0]
        e, g = c.n_routed_experts, c.n_group
        logits = jnp.einsum(
            "th,eh->te", x.astype(jnp.float32), self.weight[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        scores = jax.nn.sigmoid(logits)
        choice = jax.lax.stop_gradient(scores) + jax.lax.stop_gradient(
            self.e_score_correction_bias[...].astype(jnp.float32)
        )
        if g > 1:
            grouped = choice.reshape(t, g, e // g)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
            _, keep = jax.lax.top_k(group_scores, c.topk_group)
            group_mask = jnp.any(jnp.arange(g)[:, None] == keep[:, None, :], axis=-1)  # [T, G]
            expert_mask = jnp.repeat(group_mask, e // g, axis=1)
            choice = jnp.where(expert_mask, choice, -jnp.inf)
        _, idx = jax.lax.top_k(choice, c.num_experts_per_tok)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + ROUTER_NORM_EPS)
        return w * c.routed_scaling_factor, idx.astype(jnp.int32)


class MoE(nnx.Module):
    """``experts(x) + shared_experts(x)`` routed by ``gate`` (HF ``GlmMoeDsaMoE``).

    Args:
      config: a :class:`~jax_dsa.configs.DSAConfig` with the MoE fields set.
      rngs: parameter RNG; ``dtype``: compute dtype of the experts (routing is float32);
        ``param_dtype``: storage dtype of the expert weights (the router's are float32).
    """

    def __init__(
        self, config: DSAConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32
    ):
        c = config
        c.check_routed_experts()
        if c.n_shared_experts < 1:
            raise ValueError(
                f"MoE: n_shared_experts must be >= 1 (the block always has a shared expert, as in "
                f"transformers), got {c.n_shared_experts}"
            )
        self.config = config
        self.gate = TopkRouter(c, rngs=rngs)
        self.experts = Experts(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared_experts = MLP(
            c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, rngs=rngs, dtype=dtype,
            param_dtype=param_dtype, init_std=c.initializer_range,
        )

    def __call__(self, x, *, implementation=None, return_load=False, return_overflow=False):
        """``x [..., hidden_size]`` -> ``[..., hidden_size]`` in the compute dtype.

        ``implementation``: for the experts' grouped matmuls
        (:meth:`~jax_dsa.nn.experts.Experts.__call__`; ``None``: the op's default order).
        ``return_load``: return ``(out, load)`` with ``load [n_routed_experts]`` int32 the tokens
        each expert received (what DeepSeek-V3's bias update balances,
        :func:`jax_dsa.nn.experts.update_router_biases`). ``return_overflow``: also return the
        (token, slot) pairs a capped expert-parallel buffer dropped (int32 scalar; then
        ``(out, load, overflow)``)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat)
        y, load, overflow = self.experts(flat, w, idx, implementation=implementation,
                                         return_load=True, return_overflow=True,
                                         token_shape=shape[:-1])
        out = (y + self.shared_experts(flat)).reshape(shape)
        extra = (load,) * return_load + (overflow,) * return_overflow
        return (out, *extra) if extra else out
