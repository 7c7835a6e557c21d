"""The routed experts of both families' MoE blocks, stacked, the
non-trainable :class:`Buffer` their routers keep (correction biases, hash tables), and
DeepSeek-V3's auxiliary-loss-free balancing of the correction biases.

For a token ``x`` routed to experts ``idx`` with gate values ``w`` (the router's job)::

    out = sum_j w_j * expert_{idx_j}(x),
    expert_e(x) = down_proj[e] @ (silu(gate_proj[e] @ x) * up_proj[e] @ x)

(DeepSeek V4 clips the pre-activations: :attr:`Experts.swiglu_limit`). The (token, slot) pairs
are sorted by expert and pushed through :func:`jax_dsa.ops.grouped_matmul` (weights in their
stored ``[E, out, in]`` layout, ``transpose_rhs=True``), so the cost is that of the chosen
experts only and no token is dropped (on one device, and with expert parallelism unless
:attr:`Experts.capacity_factor` caps its buffers).

Expert parallelism: where the logical-axis rules map ``experts`` to mesh axes (``ep``), each
device holds ``E / ep`` experts; its pairs, sorted by expert, travel to the devices of their
experts and back by all-to-all (:mod:`jax_dsa.sharding.expert_dispatch`), and the same sort,
grouped matmuls and k-sum run around the exchange (one code path for both layouts). The
buffers hold the dropless worst case unless :attr:`Experts.capacity_factor` caps them; pairs a
capped buffer drops contribute zero and are counted (``return_overflow``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.nn.layers import param
from jax_dsa.ops.grouped_matmul import REGISTRY as GMM_REGISTRY
from jax_dsa.ops.grouped_matmul import grouped_matmul
from jax_dsa.sharding import expert_dispatch as dispatch_lib
from jax_dsa.sharding.constraints import check_split, explicit_axes, typed_spec
from jax_dsa.sharding.rules import logical_to_spec

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
    # Expert parallelism's exchange (jax_dsa.sharding.expert_dispatch): "ragged", "capacity" or
    # None (ragged_all_to_all where XLA has it, capacity on the host); capacity_factor None: the
    # dropless worst case. Set on a model with set_expert_dispatch.
    dispatch: str | None = None
    capacity_factor: float | None = None

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
                 return_load=False, return_overflow=False, token_shape=None):
        """``x [T, hidden]``, ``topk_weights``/``topk_indices [T, k]`` -> ``[T, hidden]`` (compute
        dtype): ``sum_j topk_weights[t, j] * expert_{topk_indices[t, j]}(x[t])``. An index
        outside ``[0, n_routed_experts)``, negative included, is an invalid slot: it adds
        nothing and is not counted in the load.

        ``implementation``: the grouped matmuls' (:func:`jax_dsa.ops.grouped_matmul`): a name, a
        sequence of names or ``None``; names it does not register are skipped, and with none
        left it uses its default order (``"cuda"`` then ``"xla"`` on a GPU). ``return_load``:
        also return the tokens per expert, ``[n_routed_experts]`` int32 (over every token,
        all shards included). ``return_overflow``: also return the (token, slot) pairs that a
        capped expert-parallel buffer dropped (int32 scalar, all shards; their contribution is
        zero; always 0 without expert parallelism or ``capacity_factor``). Results in the order
        ``(out, load, overflow)``. ``token_shape``: ``(B, S)`` when ``T`` flattens a batch
        (the MoE blocks pass it): on ``Auto`` mesh axes the tokens are pinned to the rules'
        ``batch``, ``sequence`` placement on the way in and out, so that the exchange's layout
        does not propagate into the attention around it.

        Expert parallelism: when the logical-axis rules map ``experts`` to mesh axes of the mesh
        in context (``ep``), each device holds ``n_routed_experts / ep`` experts and the pairs
        move to them and back by all-to-all under ``shard_map`` (:attr:`dispatch`,
        :attr:`capacity_factor`).

        Raises:
          ValueError: the ``experts`` mesh axes do not divide ``n_routed_experts``, or the
            tokens do not split over the token and ``experts`` axes.
        """
        n_experts = self.config.n_routed_experts
        if x.shape[0] == 0:  # no tokens (on every device alike): nothing to compute or exchange
            return _results(jnp.zeros(x.shape, self.dtype), jnp.zeros((n_experts,), jnp.int32),
                            jnp.zeros((), jnp.int32), return_load, return_overflow)
        weights = tuple(p[...].astype(self.dtype) for p in
                        (self.gate_proj, self.up_proj, self.down_proj))
        mix = functools.partial(_mix, n_experts=n_experts, limit=self.swiglu_limit,
                                implementation=GMM_REGISTRY.restrict(implementation))
        ep = expert_axes(n_experts)
        explicit = explicit_axes()
        if not ep and not explicit:
            y, load = mix(x.astype(self.dtype), topk_weights, topk_indices, *weights)
            return _results(y, load, jnp.zeros((), jnp.int32), return_load, return_overflow)
        # Under shard_map: each token shard routes its own tokens (the sort and bincount run on
        # local tokens); with ep the pairs go to the devices of their experts and back; a split
        # of the experts' inner dim is summed, the shards' loads too.
        if explicit:
            tok = _axes(typed_spec(x)[0])
            inner = typed_spec(weights[0])[1]
            inner = None if inner is None or set(_axes(inner)) & set(ep) else inner
        else:
            tok = _auto_token_axes(x.shape[0], ep, token_shape)
            inner = _auto_inner(weights[0].shape[1], ep)
        natural = tok
        tok = _token_axes(tok, ep, x.shape[0])
        tok_entry = None if not tok else (tok[0] if len(tok) == 1 else tok)
        ep_entry = None if not ep else (ep[0] if len(ep) == 1 else ep)
        specs = ((P(tok_entry, None),) * 3 + (P(ep_entry, inner, None),) * 2
                 + (P(ep_entry, None, inner),))
        args = (x.astype(self.dtype), topk_weights, topk_indices, *weights)
        if explicit:
            args = tuple(jax.sharding.reshard(a, sp) for a, sp in zip(args, specs))
        elif natural != tok:  # Auto: a hard boundary for sharding propagation, both ways
            args = tuple(_pin(a, natural) for a in args[:3]) + args[3:]
        if ep:
            mode = self.dispatch or dispatch_lib.default_mode()
            mix = functools.partial(_ep_mix, ep=ep, mode=mode,
                                    capacity_factor=self.capacity_factor, **mix.keywords)
        else:
            mix = functools.partial(_with_overflow, mix)

        def local(*a):
            y, load, overflow = mix(*a)
            if inner is not None:
                y = jax.lax.psum(y, inner)
            if tok:
                load, overflow = jax.lax.psum((load, overflow), tok)
            return y, load, overflow

        y, load, overflow = jax.shard_map(local, in_specs=specs,
                                          out_specs=(P(tok_entry, None), P(), P()),
                                          check_vma=False)(*args)
        if explicit and typed_spec(y) != typed_spec(x):
            y = jax.sharding.reshard(y, P(*typed_spec(x)))
        elif not explicit and natural != tok:
            y = _pin(y, natural)
        return _results(y, load, overflow, return_load, return_overflow)


def _results(y, load, overflow, return_load, return_overflow):
    out = (y,) + ((load,) if return_load else ()) + ((overflow,) if return_overflow else ())
    return out if len(out) > 1 else y


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def expert_axes(n_experts: int) -> tuple[str, ...]:
    """The mesh axes (of the mesh in context) that the rules split the routed experts over;
    ``()`` without a mesh, inside ``shard_map``, or when the rules map ``experts`` to none of
    its axes.

    Raises:
      ValueError: those axes do not divide ``n_experts`` (naming the axes and the rule).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Manual in mesh.axis_types:
        return ()
    check_split(n_experts, "experts", "n_routed_experts")
    return _axes(logical_to_spec(("experts",), mesh=mesh)[0])


def _auto_token_axes(t: int, ep: tuple[str, ...], token_shape) -> tuple[str, ...]:
    """On Auto axes (no typed sharding to read): the axes the rules split tokens over, batch
    then sequence (the [B, S] -> [B * S] flattening's order): with ``token_shape`` as the rules
    place a ``[B, S]`` batch, else those that are not expert axes, cut to what divides ``t``."""
    mesh = jax.sharding.get_abstract_mesh()
    if token_shape is not None and len(token_shape) == 2:
        spec = logical_to_spec(("batch", "sequence"), mesh=mesh, shape=tuple(token_shape))
        return tuple(a for e in spec for a in _axes(e))
    spec = logical_to_spec(("batch", "sequence"), mesh=mesh)
    axes = tuple(a for e in spec for a in _axes(e) if a not in ep)
    while axes and t % math.prod(mesh.shape[a] for a in axes + ep):
        axes = axes[:-1]
    return axes


def _pin(a, axes: tuple[str, ...]):
    """``a`` (tokens first) constrained to its tokens split over ``axes`` (Auto axes)."""
    entry = None if not axes else (axes[0] if len(axes) == 1 else axes)
    spec = P(entry, *(None,) * (a.ndim - 1))
    return jax.lax.with_sharding_constraint(
        a, NamedSharding(jax.sharding.get_abstract_mesh(), spec))


def _auto_inner(i: int, ep: tuple[str, ...]):
    """On Auto axes: the mesh axes the rules split the experts' inner dim (``mlp``) over, or
    None."""
    entry = logical_to_spec(("mlp",), mesh=jax.sharding.get_abstract_mesh(), shape=(i,))[0]
    return None if set(_axes(entry)) & set(ep) else entry


def _token_axes(tok: tuple[str, ...], ep: tuple[str, ...], t: int) -> tuple[str, ...]:
    """The tokens' axes with the expert axes appended: the ep devices must hold other tokens
    (where tokens are whole over an ep axis, each device takes its share).

    Raises:
      ValueError: ``t`` tokens do not split over those axes.
    """
    axes = tok + tuple(a for a in ep if a not in tok)
    mesh = jax.sharding.get_abstract_mesh()
    n = math.prod(mesh.shape[a] for a in axes) if axes else 1
    if t % n:
        raise ValueError(
            f"Experts: {t} tokens (batch x sequence) do not split over mesh axes {axes} (size "
            f"{n}): the token axes and the experts' axes {ep}; use a batch x sequence that "
            f"divides by {n}")
    return axes


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
def _gather_tokens(x, order, inverse, k):
    """``x [T, H]`` -> ``[T*k, H]``: row ``i`` is ``x[order[i] // k]`` (the sorted pairs'
    tokens). Backward: the gradient rows gathered back to (token, slot) order by ``inverse`` and
    summed over the k slots in float32 (no scatter-add)."""
    return x[order // k]


def _gather_tokens_fwd(x, order, inverse, k):
    return x[order // k], (inverse,)


def _gather_tokens_bwd(k, res, d):
    (inverse,) = res
    dx = d[inverse].reshape(d.shape[0] // k, k, d.shape[-1]).astype(jnp.float32).sum(1)
    return dx.astype(d.dtype), None, None


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


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


def _sort_pairs(keys, n_groups):
    """``keys [N]`` int (group ids) -> ``(order, inverse, group_sizes)``: the stable sort that
    groups rows by key, its inverse, and the rows per group (int32). A key outside
    ``[0, n_groups)`` (negative included) is in no group: its rows sort after every group's and
    are not counted, so the grouped matmuls give them zero."""
    keys = jnp.where((keys >= 0) & (keys < n_groups), keys, n_groups)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    inverse = jnp.argsort(order).astype(jnp.int32)  # each row's place in the sorted order
    return order, inverse, jnp.bincount(keys, length=n_groups).astype(jnp.int32)


def _ffn(xs, group_sizes, gate_proj, up_proj, down_proj, *, limit, implementation):
    """The experts on rows sorted by expert (``group_sizes`` rows each; rows past their sum
    come out zero): ``down(silu(gate(x)) * up(x))``, pre-activations clipped at ``limit``."""
    gmm = functools.partial(grouped_matmul, group_sizes=group_sizes, transpose_rhs=True,
                            implementation=implementation)
    gate = gmm(xs, gate_proj)
    up = gmm(xs, up_proj)
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gmm(jax.nn.silu(gate) * up, down_proj)


def _weighted_sum(ys, order, inverse, topk_weights):
    """The sorted pairs' outputs ``ys [T*k, H]`` back in (token, slot) order and summed over the
    k slots with the gate values: ``[T, H]`` in ``ys``'s dtype."""
    t, k = topk_weights.shape
    y = _permute(ys, inverse, order).reshape(t, k, ys.shape[-1])
    # an elementwise product and a k-sum (a fused reduce in float32, not a dot that a GPU may
    # run in TF32)
    out = (y.astype(jnp.float32) * topk_weights.astype(jnp.float32)[..., None]).sum(1)
    return out.astype(ys.dtype)


def _mix(x, topk_weights, topk_indices, gate_proj, up_proj, down_proj, *, n_experts,
         limit=None, implementation=None, ffn=None):
    """The routed experts on one set of tokens (weights in the PyTorch ``[E, out, in]`` layout);
    ``limit``: clip the gate pre-activation above at ``limit`` and the up one to ``[-limit,
    limit]`` (``None``: no clip). ``ffn``: what runs on the sorted pairs, ``(xs, group_sizes,
    *weights) -> (ys, extra)`` (default: the grouped matmuls here; expert parallelism passes
    the exchange around them). Returns ``(out [T, H], tokens per expert [E] int32)``, plus
    ``extra`` with ``ffn``."""
    k = topk_indices.shape[1]
    order, inverse, group_sizes = _sort_pairs(topk_indices.reshape(-1), n_experts)
    xs = _gather_tokens(x, order, inverse, k)  # [T*k, H], sorted by expert
    if ffn is None:
        ys = _ffn(xs, group_sizes, gate_proj, up_proj, down_proj, limit=limit,
                  implementation=implementation)
        return _weighted_sum(ys, order, inverse, topk_weights), group_sizes
    ys, extra = ffn(xs, group_sizes, gate_proj, up_proj, down_proj)
    return _weighted_sum(ys, order, inverse, topk_weights), group_sizes, extra


def _with_overflow(mix, *args):
    y, load = mix(*args)
    return y, load, jnp.zeros((), jnp.int32)


def _ep_mix(x, topk_weights, topk_indices, gate_proj, up_proj, down_proj, *, ep, mode,
            capacity_factor, n_experts, limit, implementation):
    """:func:`_mix` inside ``shard_map`` with the experts split over the mesh axes ``ep``:
    this device's pairs, sorted by expert, go to the devices of their experts
    (:func:`jax_dsa.sharding.expert_dispatch.dispatch`), are sorted there by local expert and
    run through the grouped matmuls on this device's ``E / ep`` experts, and come back
    (:func:`~jax_dsa.sharding.expert_dispatch.combine`) to the same k-sum. Returns ``(out,
    tokens per expert [E] of this device's tokens, pairs dropped here)``."""
    local = gate_proj.shape[0]  # E / ep

    def exchange(xs, group_sizes, *weights):
        pairs = xs.shape[0]
        n = n_experts // local
        rows = dispatch_lib.buffer_rows(pairs, n, mode, capacity_factor)
        counts = jax.lax.all_gather(group_sizes, ep)  # [ep, E]: every device's pairs
        p = dispatch_lib.plan(counts, jax.lax.axis_index(ep), mode=mode, rows=rows)
        received = dispatch_lib.dispatch(xs, p, axis=ep, mode=mode, rows=rows)
        order, inverse, sizes = _sort_pairs(
            dispatch_lib.receive_keys(p, received.shape[0]), local + 1)  # padding last
        ys = _ffn(_permute(received, order, inverse), sizes[:local], *weights,
                  limit=limit, implementation=implementation)
        ys = _permute(ys, inverse, order)
        return dispatch_lib.combine(ys, p, axis=ep, mode=mode, pairs=pairs), p.overflow

    return _mix(x, topk_weights, topk_indices, gate_proj, up_proj, down_proj,
                n_experts=n_experts, limit=limit, implementation=implementation, ffn=exchange)


# DeepSeek-V3's auxiliary-loss-free load balancing -----------------------------------------------


def moe_blocks(model) -> list:
    """A language model's MoE blocks in the order of its ``aux["expert_load"]``: the
    ``mlp`` of each layer that has routed experts, in layer order, then each MTP depth's (DeepSeek
    V4 with ``mtp=True``)."""
    layers = list(model.layers) + list(getattr(model, "mtp", None) or ())
    return [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]


def set_expert_dispatch(model, dispatch: str | None = None,
                        capacity_factor: float | None = None) -> int:
    """Sets expert parallelism's exchange on every routed-experts module of ``model`` (any
    NNX module; in place, a static setting: jitted steps retrace). ``dispatch``: ``"ragged"``
    (``jax.lax.ragged_all_to_all``, exact rows; needs XLA:GPU or TPU), ``"capacity"``
    (``jax.lax.all_to_all`` of fixed ``[ep, C, hidden]`` blocks; runs everywhere) or ``None``
    (ragged where the mesh's devices are GPUs or TPUs, capacity on the host).
    ``capacity_factor``: ``None`` sizes the buffers for the dropless worst case; ``f`` caps them
    at ``f`` times the balanced share: ``"capacity"`` per (source, destination) block,
    ``"ragged"`` per destination, shared max-min fairly among the sources (so with the same
    ``f`` a skewed routing loses fewer pairs there); pairs past the cap are dropped (the last
    in expert order), contribute zero and are counted in ``aux["expert_overflow"]``. Returns
    how many modules were set.

    Raises:
      ValueError: an unknown ``dispatch`` or a ``capacity_factor`` that is not a finite number
        > 0.
    """
    if dispatch is not None and dispatch not in dispatch_lib.MODES:
        raise ValueError(f"set_expert_dispatch: dispatch must be one of "
                         f"{dispatch_lib.MODES} or None, got {dispatch!r}")
    if capacity_factor is not None and not (capacity_factor > 0
                                            and math.isfinite(capacity_factor)):
        raise ValueError(f"set_expert_dispatch: capacity_factor must be a finite number > 0, "
                         f"got {capacity_factor}")
    count = 0
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Experts):
            module.dispatch, module.capacity_factor = dispatch, capacity_factor
            count += 1
    return count


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
    "Buffer", "Experts", "ROUTER_NORM_EPS", "expert_axes", "moe_blocks", "router_bias_step",
    "set_expert_dispatch", "update_router_biases",
]
