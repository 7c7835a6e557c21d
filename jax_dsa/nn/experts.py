"""The routed experts of both families' MoE blocks, stacked and run dropless, the
non-trainable :class:`Buffer` their routers keep (correction biases, hash tables), and
DeepSeek-V3's auxiliary-loss-free balancing of the correction biases.

For a token ``x`` routed to experts ``idx`` with gate values ``w`` (the router's job)::

    out = sum_j w_j * expert_{idx_j}(x),
    expert_e(x) = down_proj[e] @ (silu(gate_proj[e] @ x) * up_proj[e] @ x)

(DeepSeek V4 clips the pre-activations: :attr:`Experts.swiglu_limit`). The (token, slot) pairs
are sorted by expert and pushed through :func:`jax_dsa.ops.grouped_matmul` (weights in their
stored ``[E, out, in]`` layout, ``transpose_rhs=True``), so the cost is that of the chosen
experts only and no token is ever dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_dsa.nn.layers import param
from jax_dsa.ops.grouped_matmul import REGISTRY as GMM_REGISTRY
from jax_dsa.ops.grouped_matmul import grouped_matmul
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

    def __call__(self, x, topk_weights, topk_indices, *, implementation=None,
                 return_load=False):
        """``x [T, hidden]``, ``topk_weights``/``topk_indices [T, k]`` -> ``[T, hidden]`` (compute
        dtype): ``sum_j topk_weights[t, j] * expert_{topk_indices[t, j]}(x[t])``.

        ``implementation``: the grouped matmuls' (:func:`jax_dsa.ops.grouped_matmul`): a name, a
        sequence of names or ``None``; names it does not register are skipped, and with none
        left it uses its default order (``"cuda"`` then ``"xla"`` on a GPU). ``return_load``:
        also return the tokens per expert, ``[n_routed_experts]`` int32 (over every token,
        all shards included)."""
        weights = tuple(p[...].astype(self.dtype) for p in
                        (self.gate_proj, self.up_proj, self.down_proj))
        mix = functools.partial(_mix, n_experts=self.config.n_routed_experts,
                                limit=self.swiglu_limit,
                                implementation=GMM_REGISTRY.restrict(implementation))
        if not explicit_axes():
            y, load = mix(x.astype(self.dtype), topk_weights, topk_indices, *weights)
            return (y, load) if return_load else y
        # Explicit mesh axes: each token shard routes its own tokens through every expert (the
        # sort and bincount run on local tokens); a split of the experts' inner dim is summed,
        # the shards' loads too.
        tok = typed_spec(x)[0]
        inner = typed_spec(weights[0])[1]
        specs = (P(tok, None),) * 3 + (P(None, inner, None),) * 2 + (P(None, None, inner),)
        args = tuple(jax.sharding.reshard(a, sp) for a, sp in
                     zip((x.astype(self.dtype), topk_weights, topk_indices, *weights), specs))

        def local(*a):
            y, load = mix(*a)
            if inner is not None:
                y = jax.lax.psum(y, inner)
            if tok is not None:
                load = jax.lax.psum(load, tok)
            return y, load

        y, load = jax.shard_map(local, in_specs=specs, out_specs=(P(tok, None), P()),
                                check_vma=False)(*args)
        return (y, load) if return_load else y


# The permutation between (token, slot) order and expert-sorted order is applied by gathers in
# both directions, forward and backward (custom VJPs below): a gather by the inverse permutation
# plus a weighted sum over the k slots, never a scatter-add. A scatter-add of duplicate indices
# (each token appears k times) sums in an unspecified order on a GPU, so its result varies from
# run to run; the gathers and the fixed-order k-sum are deterministic, and no [E, T, .] array
# is ever formed. Gate and up stay two grouped matmuls: one fused [E, 2I, H] matmul would read
# the sorted tokens once instead of twice, but the checkpoints' layout stores them apart, so it
# would copy (concatenate) every expert weight at every step (and split the gradient back),
# which costs more than the second read of the [T*k, H] tokens saves.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, order, inverse, k):
    """``x [T, H]`` -> ``[T*k, H]``: row ``i`` is ``x[order[i] // k]`` (the sorted pairs'
    tokens). Backward: the gradient rows gathered back to (token, slot) order by ``inverse`` and
    summed over the k slots in float32 (no scatter-add)."""
    return x[order // k]


def _dispatch_fwd(x, order, inverse, k):
    return x[order // k], (inverse,)


def _dispatch_bwd(k, res, d):
    (inverse,) = res
    dx = d[inverse].reshape(-1, k, d.shape[-1]).astype(jnp.float32).sum(1)
    return dx.astype(d.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _permute(a, perm, inverse):
    """``a[perm]`` for a permutation ``perm`` with inverse ``inverse``; backward: ``d[inverse]``
    (a gather, where autodiff would scatter-add)."""
    return a[perm]


def _permute_fwd(a, perm, inverse):
    return a[perm], (inverse,)


def _permute_bwd(res, d):
    (inverse,) = res
    return d[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _mix(x, topk_weights, topk_indices, gate_proj, up_proj, down_proj, *, n_experts,
         limit=None, implementation=None):
    """The routed experts on one set of tokens (weights in the PyTorch ``[E, out, in]`` layout);
    ``limit``: clip the gate pre-activation above at ``limit`` and the up one to ``[-limit,
    limit]`` (``None``: no clip). Returns ``(out [T, H], tokens per expert [E] int32)``."""
    t, k = topk_indices.shape
    flat = topk_indices.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # pairs grouped by expert
    inverse = jnp.argsort(order).astype(jnp.int32)  # each pair's row in the sorted order
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    gmm = functools.partial(grouped_matmul, group_sizes=group_sizes, transpose_rhs=True,
                            implementation=implementation)
    xs = _dispatch(x, order, inverse, k)  # [T*k, H], sorted by expert
    gate = gmm(xs, gate_proj)
    up = gmm(xs, up_proj)
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    h = jax.nn.silu(gate) * up
    ys = gmm(h, down_proj)  # [T*k, H], sorted by expert
    y = _permute(ys, inverse, order).reshape(t, k, -1)  # back to (token, slot) order
    # an elementwise product and a k-sum (a fused reduce in float32, not a dot that a GPU may
    # run in TF32)
    out = (y.astype(jnp.float32) * topk_weights.astype(jnp.float32)[..., None]).sum(1)
    return out.astype(ys.dtype), group_sizes


# DeepSeek-V3's auxiliary-loss-free load balancing -----------------------------------------------


def moe_blocks(model) -> list:
    """A language model's MoE blocks in the order of its ``aux["expert_load"]``: the
    ``mlp`` of each layer that has routed experts, in layer order, then each MTP depth's (DeepSeek
    V4 with ``mtp=True``)."""
    layers = list(model.layers) + list(getattr(model, "mtp", None) or ())
    return [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]


def router_bias_step(bias, load, rate):
    """``bias + rate * sign(mean(load) - load)``: DeepSeek-V3 (arXiv:2412.19437 §2.1.2) lowers
    the correction bias of an overloaded expert by ``rate`` (the paper's bias update speed
    γ = 0.001) and raises an underloaded one's; float32 ``[E]``."""
    load = jnp.asarray(load, jnp.float32)
    return (bias.astype(jnp.float32) + rate * jnp.sign(load.mean() - load)).astype(bias.dtype)


def update_router_biases(model, expert_load, rate) -> int:
    """Applies :func:`router_bias_step` in place to the ``e_score_correction_bias`` of every MoE
    router that has one (GLM-5 / V3.2 routers, DeepSeek V4's top-k ones; V4's hash-routed layers
    have none and are skipped), from the model's ``aux["expert_load"]`` (one ``[E]`` per block of
    :func:`moe_blocks`). Not a gradient step: call it after the optimizer's, e.g. on the model
    merged from the new parameters. Returns how many biases moved.

    Raises:
      ValueError: ``expert_load`` does not have one entry per MoE block.
    """
    blocks = moe_blocks(model)
    if len(expert_load) != len(blocks):
        raise ValueError(f"update_router_biases: {len(expert_load)} expert loads for "
                         f"{len(blocks)} MoE blocks")
    moved = 0
    for block, load in zip(blocks, expert_load):
        bias = getattr(block.gate, "e_score_correction_bias", None)
        if bias is None:
            continue
        bias[...] = router_bias_step(bias[...], load, rate)
        moved += 1
    return moved


__all__ = [
    "Buffer", "Experts", "ROUTER_NORM_EPS", "moe_blocks", "router_bias_step",
    "update_router_biases",
]
