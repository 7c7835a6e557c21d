"""DeepSeek V4's mixture-of-experts block: top-k or hash routing, clipped SwiGLU experts, one
shared expert.

Math and parameter names: transformers 5.24 ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``
(``gate.weight``, ``gate.e_score_correction_bias``, ``gate.tid2eid``), ``DeepseekV4Experts``,
``DeepseekV4MLP`` and ``DeepseekV4SparseMoeBlock``; DeepSeek-V4 report §2.1. For a token ``x``
with id ``t``::

    s    = score(gate.weight @ x)              score: sqrt(softplus) or sigmoid (float32)
    idx  = top num_experts_per_tok of s + e_score_correction_bias        ("moe" layers)
    idx  = tid2eid[t]                                                    ("hash_moe" layers)
    w    = routed_scaling_factor * s[idx] / (sum s[idx] + 1e-20)
    out  = sum_j w_j * expert_{idx_j}(x) + shared_experts(x)

with ``expert(x) = down(silu(min(gate(x), L)) * clip(up(x), -L, L))``, ``L = swiglu_limit``, for
the routed and the shared experts alike. Unlike GLM-5 / V3.2 there is no group-limited routing and
the gate values are always normalised (transformers ignores ``norm_topk_prob``). The routed
experts run dropless through :class:`jax_dsa.nn.experts.Experts` (stacked ``gate_proj`` /
``up_proj`` / ``down_proj``; transformers fuses the first two as ``gate_up_proj``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.nn.experts import ROUTER_NORM_EPS, Buffer, Experts
from jax_dsa.nn.layers import param
from jax_dsa.nn.mlp import MLP
from jax_dsa.sharding import constrain
from jax_dsa.sharding.constraints import explicit_axes, out_spec, typed_spec


def score(logits, scoring_func: str):
    """Router affinities from float32 ``logits [..., E]`` (transformers ``ACT2FN[scoring_func]``).

    Raises:
      ValueError: an unknown ``scoring_func``.
    """
    if scoring_func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"score: unknown scoring_func {scoring_func!r}")


def _gate_values(scores, idx, scale):
    w = jnp.take_along_axis(scores, idx, axis=-1)
    return w / (w.sum(-1, keepdims=True) + ROUTER_NORM_EPS) * scale


class _Router(nnx.Module):
    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.weight = param(
            rngs, nnx.initializers.normal(c.initializer_range), (c.n_routed_experts, c.hidden_size),
            jnp.float32, (None, "embed"),  # every token scores every expert: whole
        )

    def scores(self, x):
        logits = jnp.einsum(
            "th,eh->te", x.astype(jnp.float32), self.weight[...].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        return score(logits, self.config.scoring_func)


class TopkRouter(_Router):
    """The learned router of ``"moe"`` layers (HF ``mlp.gate``): ``weight [n_routed_experts,
    hidden_size]`` float32 (``Param``), ``e_score_correction_bias [n_routed_experts]`` float32
    (a :class:`~jax_dsa.nn.experts.Buffer`, zeros at init: it moves the choice, not the values)."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.e_score_correction_bias = Buffer(
            jnp.zeros((config.n_routed_experts,), jnp.float32), out_sharding=(None,),
            eager_sharding=False,
        )

    def __call__(self, x, input_ids=None):
        """``x [T, hidden]`` -> ``(weights [T, k] float32, indices [T, k] int32)``; the choice
        carries no gradient, the gate values do. ``input_ids`` is ignored."""
        c = self.config
        s = self.scores(x)
        choice = jax.lax.stop_gradient(s) + jax.lax.stop_gradient(
            self.e_score_correction_bias[...].astype(jnp.float32))
        _, idx = jax.lax.top_k(choice, c.num_experts_per_tok)
        return _gate_values(s, idx, c.routed_scaling_factor), idx.astype(jnp.int32)


def default_tid2eid(vocab_size: int, n_experts: int, k: int):
    """A fixed table for a freshly initialised hash layer: token ``t`` goes to experts
    ``(t + j) mod n_experts``, ``j < k`` (distinct, balanced over the vocabulary). transformers
    initialises the table to zeros; a checkpoint brings its own."""
    return (jnp.arange(vocab_size)[:, None] + jnp.arange(k)[None, :]) % n_experts


class HashRouter(_Router):
    """The router of ``"hash_moe"`` layers (HF ``mlp.gate``): the experts of token ``t`` are
    ``tid2eid[t]`` (``[vocab_size, num_experts_per_tok]`` int32 :class:`~jax_dsa.nn.experts.Buffer`,
    frozen); ``weight [n_routed_experts, hidden_size]`` float32 gives their gate values."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c = config
        self.tid2eid = Buffer(
            default_tid2eid(c.vocab_size, c.n_routed_experts, c.num_experts_per_tok).astype(
                jnp.int32),
            out_sharding=("hash_vocab", "hash_slot"), eager_sharding=False,
        )

    def __call__(self, x, input_ids):
        """``x [T, hidden]``, ``input_ids [T]`` -> ``(weights [T, k] float32, indices [T, k]
        int32)``.

        Raises:
          ValueError: ``input_ids`` missing or not ``[T]``.
        """
        c = self.config
        if input_ids is None or input_ids.shape != x.shape[:1]:
            raise ValueError(
                "HashRouter: a hash_moe layer needs input_ids of shape [T] = "
                f"{x.shape[:1]}, got {None if input_ids is None else input_ids.shape}"
            )
        table = self.tid2eid[...]
        if explicit_axes():  # the rows follow the ids' sharding
            idx = table.at[input_ids].get(mode="clip", out_sharding=out_spec(
                typed_spec(input_ids), None))
        else:
            idx = jnp.take(table, input_ids, axis=0, mode="clip")
        idx = jax.lax.stop_gradient(idx).astype(jnp.int32)
        return _gate_values(self.scores(x), idx, c.routed_scaling_factor), idx


class V4Experts(Experts):
    """:class:`jax_dsa.nn.experts.Experts` with the pre-activations clipped at ``swiglu_limit``."""

    def __init__(
        self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        super().__init__(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.swiglu_limit = float(config.swiglu_limit)


class V4MLP(MLP):
    """The shared expert (transformers ``DeepseekV4MLP``): a SwiGLU MLP of width
    ``moe_intermediate_size`` whose gate / up pre-activations are clipped like the experts'."""

    def __init__(
        self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
        param_dtype=jnp.float32,
    ):
        super().__init__(config.hidden_size, config.moe_intermediate_size, rngs=rngs, dtype=dtype,
                         param_dtype=param_dtype, init_std=config.initializer_range)
        self.limit = float(config.swiglu_limit)

    def __call__(self, x):
        """``x [..., hidden]`` -> ``[..., hidden]`` in the compute dtype."""
        gate = jnp.minimum(self.gate_proj(x), self.limit)
        up = jnp.clip(self.up_proj(x), -self.limit, self.limit)
        hidden = jax.nn.silu(gate) * up
        if hidden.ndim == 3:
            hidden = constrain(hidden, ("batch", "sequence", "mlp"))
        return self.down_proj(hidden)


class DeepseekV4MoE(nnx.Module):
    """One layer's MoE block (HF ``layers.N.mlp``): ``gate`` (:class:`TopkRouter` or
    :class:`HashRouter` by ``config.mlp_layer_types[layer_idx]``), ``experts``
    (:class:`V4Experts`), ``shared_experts`` (:class:`V4MLP`).

    Args:
      config: the model's :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config`;
        layer_idx: which layer.
      rngs: parameter RNG; ``dtype``: compute dtype of the experts (routing is float32);
        ``param_dtype``: storage dtype of the expert weights (the routers' stay float32).

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
                f"DeepseekV4MoE: layer_idx {layer_idx} not in [0, {c.num_hidden_layers})"
            )
        self.config = config
        self.is_hash = c.is_hash_layer(layer_idx)
        self.gate = (HashRouter if self.is_hash else TopkRouter)(c, rngs=rngs)
        self.experts = V4Experts(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.shared_experts = V4MLP(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x, input_ids=None, *, implementation=None, return_load=False,
                 return_overflow=False):
        """``x [..., hidden_size]``, ``input_ids`` of shape ``x.shape[:-1]`` (needed by hash
        layers) -> ``[..., hidden_size]`` in the compute dtype; ``(out, load [n_routed_experts]
        int32)`` (tokens per expert) with ``return_load``, and then the pairs a capped
        expert-parallel buffer dropped (int32 scalar) with ``return_overflow``.
        ``implementation``: for the experts' grouped matmuls (``None``: the op's default
        order)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        ids = None if input_ids is None else input_ids.reshape(-1)
        w, idx = self.gate(flat, ids)
        y, load, overflow = self.experts(flat, w, idx, implementation=implementation,
                                         return_load=True, return_overflow=True,
                                         token_shape=shape[:-1])
        out = (y + self.shared_experts(flat)).reshape(shape)
        extra = (load,) * return_load + (overflow,) * return_overflow
        return (out, *extra) if extra else out

__all__ = [
    "DeepseekV4MoE", "HashRouter", "TopkRouter", "V4Experts", "V4MLP", "default_tid2eid", "score",
]
