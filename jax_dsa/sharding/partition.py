"""How the DSA ops split over a device mesh: data, tensor and context parallelism.

Every public op runs its per-implementation kernel through :func:`partitioned_call`, which picks
one of four forms from the mesh in context:

* mesh axes of type ``Auto`` (``jax.jit`` over a mesh): a
  ``jax.experimental.custom_partitioning`` op with a Shardy sharding rule. Its ``partition``
  callback reads the layout from the sharding the partitioner proposes for the query operand and
  returns the operand shardings the kernel needs (key-sequence dims whole), so the partitioner
  inserts the all-gathers; results that are partial sums are reduced inside the lowered kernel
  (``psum_scatter`` / ``psum``). One device, or no mesh: the op inlines the plain kernel.
* mesh axes of type ``Explicit``: the same kernel under ``jax.shard_map`` with the layout read
  from the operands' typed shardings; the all-gathers and reductions are written out. (A bare
  kernel would be silently all-gathered to the global batch: jax-ml/jax#38551.)
* inside a ``shard_map`` (``Manual`` axes): the kernel on the local shards, as the caller wrote;
  its results typed as varying over the manual axes its operands vary over (``check_vma``).
* under ``jax.vmap``: the kernel vmapped, unpartitioned (``jax.custom_batching.custom_vmap``).

Dims of each operand and result are described by a role string, one letter per dim:

* ``b`` batch, split over the layout's batch axes (data parallel);
* ``s`` query sequence, split over the layout's sequence axes (context parallel), kept local;
* ``t`` key sequence, whole on every shard: gathered over the sequence axes;
* ``T`` (results) key sequence of a partial sum: reduce-scattered back over the sequence axes;
* ``h`` heads of the main attention, split over the layout's head axes (tensor parallel);
* ``.`` any other dim, whole on every shard.

A result also names the roles whose axes it is summed over (``"bs"``: a partial sum over the
local batch and query rows). The layout comes from the first operand carrying each role (the
query). Row indices into the keys are global, so a context-parallel shard's indices point into
the gathered keys unchanged. Pattern: all-gather context parallelism as in Megatron-LM's DSA
(``cp_comm_type=allgather``) and NVIDIA TransformerEngine's ``FusedAttnCPWithAllGather``; see
``shared/research/jax_ffi.md`` section 5 and ``models.md`` section 3.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

_ROLE_LETTERS = frozenset("bsthT.")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axes carrying each role in one call; empty tuples mean "not split".

    Attributes:
      batch: axes splitting ``b`` dims (data parallel).
      seq: axes splitting ``s`` dims and gathering ``t`` dims (context parallel).
      heads: axes splitting ``h`` dims (tensor parallel).
      scatter_t: results' ``T`` dims are reduce-scattered over ``seq`` (else summed whole).
    """

    batch: tuple[str, ...] = ()
    seq: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    scatter_t: bool = False

    def axes(self, role: str) -> tuple[str, ...]:
        return {"b": self.batch, "s": self.seq, "h": self.heads}.get(role, ())

    def spec(self, roles: str, *, t_split: bool = False) -> P:
        """PartitionSpec of an array with these roles (``t`` split over ``seq`` if ``t_split``;
        ``T`` split when :attr:`scatter_t`)."""
        out = []
        for r in roles:
            if r in "bsh":
                axes = self.axes(r)
            elif r == "T":
                axes = self.seq if self.scatter_t else ()
            elif r == "t":
                axes = self.seq if t_split else ()
            else:
                axes = ()
            out.append(_entry(axes))
        return P(*out)


@dataclasses.dataclass(frozen=True)
class Result:
    """A result's role string and the roles whose axes it is a partial sum over."""

    roles: str
    summed_over: str = ""


def _entry(axes):
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def _spec_axes(spec, dim) -> tuple[str, ...]:
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return ()
    e = spec[dim]
    return (e,) if isinstance(e, str) else tuple(e)


def derive_layout(axis_sizes: dict, roles, shapes, specs) -> Layout:
    """The layout of one call from its operands' specs (``None`` spec: replicated).

    For each of ``b``, ``s``, ``h`` the first operand with that role decides the axes. Axes
    already used by an earlier role, or whose size does not divide every dim of that role, are
    dropped (those dims stay whole).
    """
    chosen, used = {}, set()
    for letter in "bsh":
        axes = ()
        for r, spec in zip(roles, specs):
            i = r.find(letter)
            if i >= 0:
                axes = _spec_axes(spec, i)
                break
        axes = tuple(a for a in axes if a not in used)
        n = math.prod(axis_sizes[a] for a in axes)
        for r, shape in zip(roles, shapes):
            for d, role in enumerate(r):
                if role == letter and shape[d] % n:
                    axes, n = (), 1
        used.update(axes)
        chosen[letter] = axes
    seq = chosen["s"]
    n_seq = math.prod(axis_sizes[a] for a in seq)
    scatter_t = bool(seq) and all(
        shape[d] % n_seq == 0
        for r, shape in zip(roles, shapes)
        for d, role in enumerate(r)
        if role == "t"
    )
    return Layout(chosen["b"], seq, chosen["h"], scatter_t)


def _reduce(y, result: Result, layout: Layout):
    """Turns a per-shard partial result into this shard's part of the total."""
    axes = tuple(a for letter in result.summed_over for a in layout.axes(letter))
    if "T" in result.roles and layout.seq:
        if layout.scatter_t:
            y = jax.lax.psum_scatter(
                y, layout.seq, scatter_dimension=result.roles.index("T"), tiled=True
            )
        else:
            axes = axes + layout.seq
    if axes:
        y = jax.lax.psum(y, axes)
    return y


def _local_with_collectives(local, layout, results, args):
    outs = local(layout, *args)
    return tuple(_reduce(y, r, layout) for y, r in zip(outs, results))


def _check_roles(name, args, roles, results):
    if len(args) != len(roles):
        raise ValueError(f"{name}: {len(args)} operands but {len(roles)} role strings")
    for x, r in zip(args, roles):
        if len(r) != x.ndim or not set(r) <= _ROLE_LETTERS - {"T"}:
            raise ValueError(
                f"{name}: role string {r!r} does not fit an operand of shape {x.shape}"
            )
    for res in results:
        if not set(res.roles) <= _ROLE_LETTERS - {"t"}:
            raise ValueError(f"{name}: bad result role string {res.roles!r}")


def _sharding_rule(roles, results):
    """Einsum-like Shardy rule: one factor per role letter, a fresh one per ``.`` dim."""
    fresh = iter(range(1 << 30))
    extra = []

    def dims(r):
        out = []
        for c in r:
            if c == ".":
                name = f"x{next(fresh)}"
                extra.append(name)
                out.append(name)
            else:
                out.append({"T": "t"}.get(c, c))
        return " ".join(out)

    rule = ", ".join(dims(r) for r in roles) + " -> " + ", ".join(dims(r.roles) for r in results)
    # Shardy wants the special factors in the order the factors first appear.
    order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
    replicated = set(extra) | {"t"}
    return rule, tuple(f for f in order if f in replicated)


def _context_mesh(args):
    for x in args:
        mesh = jax.typeof(x).sharding.mesh
        if not mesh.empty:
            return mesh
    return jax.sharding.get_abstract_mesh()


def partitioned_call(name: str, local, args, roles, results):
    """Runs ``local(layout, *args)`` split over the mesh in context; returns a tuple of results.

    Args:
      name: the op's name (error messages).
      local: ``local(layout, *args) -> tuple`` computing on one shard's operands, with every
        ``t`` dim whole; it may use collectives over ``layout``'s axes.
      args: the operands (arrays).
      roles: one role string per operand.
      results: one :class:`Result` per output of ``local``.

    Raises:
      ValueError: role strings that do not fit the operands.
    """
    args = tuple(args)
    roles = tuple(roles)
    results = tuple(results)
    _check_roles(name, args, roles, results)

    if not any(isinstance(x, jax.core.Tracer) for x in args) and not any(
        AxisType.Explicit in tuple(jax.typeof(x).sharding.mesh.axis_types) for x in args
    ):
        # Eager: a custom_partitioning op would run its plain body op by op anyway.
        return tuple(local(Layout(), *args))

    @custom_vmap
    def call(*args):
        mesh = _context_mesh(args)
        types = () if mesh.empty else tuple(mesh.axis_types)
        if AxisType.Manual in types:
            return _varying_like(local(Layout(), *args), args)
        if AxisType.Explicit in types:
            return _shard_map_call(mesh, local, args, roles, results)
        return _custom_partitioning_call(local, args, roles, results)

    @call.def_vmap
    def _vmap_rule(axis_size, in_batched, *args):
        in_axes = tuple(0 if b else None for b in in_batched)
        outs = _varying_like(jax.vmap(
            functools.partial(local, Layout()), in_axes=in_axes, axis_size=axis_size
        )(*args), args)
        return outs, tuple(True for _ in outs)

    return tuple(call(*args))


def _varying(x) -> frozenset:
    """Manual mesh axes over which ``x`` varies (its type's ``manual_axis_type``)."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _varying_like(outs, args) -> tuple:
    """``outs`` typed as varying over every manual mesh axis an operand varies over (inside
    ``shard_map`` with ``check_vma``). FFI calls return untyped results, and a result typed
    invariant would make its transpose sum the cotangent over that axis."""
    axes = frozenset().union(*(_varying(x) for x in args))
    return tuple(o if not axes - _varying(o)
                 else jax.lax.pcast(o, tuple(sorted(axes - _varying(o))), to="varying")
                 for o in outs)


def _custom_partitioning_call(local, args, roles, results):
    # custom_partitioning takes no closed-over constants (a kernel may well have some, e.g. an
    # empty index array): trace once, and pass the constants as extra replicated operands.
    closed = jax.make_jaxpr(lambda *a: tuple(local(Layout(), *a)))(*args)
    consts = [jnp.asarray(c) for c in closed.consts]
    shapes = [c.shape for c in consts]
    n = len(args)

    def unpartitioned(*operands):
        cs = [c.reshape(shape) for c, shape in zip(operands[n:], shapes)]
        return tuple(jax.core.eval_jaxpr(closed.jaxpr, cs, *operands[:n]))

    op = custom_partitioning(unpartitioned)
    const_roles = tuple("." * max(len(shape), 1) for shape in shapes)
    all_roles = roles + const_roles

    def partition(mesh, arg_shapes, result_shape):
        layout = derive_layout(
            dict(mesh.shape), all_roles, [a.shape for a in arg_shapes],
            [getattr(a.sharding, "spec", None) for a in arg_shapes],
        )
        arg_shardings = tuple(NamedSharding(mesh, layout.spec(r)) for r in all_roles)
        result_shardings = tuple(NamedSharding(mesh, layout.spec(r.roles)) for r in results)

        def lower(*operands):
            return _local_with_collectives(local, layout, results, operands[:n])

        return mesh, lower, result_shardings, arg_shardings

    rule, replicated = _sharding_rule(all_roles, results)
    op.def_partition(partition, sharding_rule=rule, need_replication_factors=replicated)
    return op(*args, *(c.reshape((-1,)) if c.ndim == 0 else c for c in consts))


def _shard_map_call(mesh, local, args, roles, results):
    specs = [jax.typeof(x).sharding.spec for x in args]
    layout = derive_layout(dict(mesh.shape), roles, [x.shape for x in args], specs)

    def split_like_queries(r, spec):
        dims = [d for d, c in enumerate(r) if c == "t"]
        return bool(dims) and layout.scatter_t and all(
            _spec_axes(spec, d) == layout.seq for d in dims
        )

    # Keys that come split like the queries are gathered inside; others come in whole.
    t_split = tuple(split_like_queries(r, spec) for r, spec in zip(roles, specs))
    in_specs = tuple(layout.spec(r, t_split=ts) for r, ts in zip(roles, t_split))
    out_specs = tuple(layout.spec(r.roles) for r in results)
    args = tuple(jax.sharding.reshard(x, s) for x, s in zip(args, in_specs))

    def body(*local_args):
        gathered = []
        for x, r, ts in zip(local_args, roles, t_split):
            if ts:
                for d, c in enumerate(r):
                    if c == "t":
                        x = jax.lax.all_gather(x, layout.seq, axis=d, tiled=True)
            gathered.append(x)
        return _local_with_collectives(local, layout, results, gathered)

    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )(*args)


# ----------------------------------------------------------------------------------------------
# Collectives used inside kernels


def head_logsumexp(x, axis: int, layout: Layout):
    """``logsumexp`` over ``axis`` (a heads dim) and over the shards of ``layout.heads``.

    Stable across shards: the maximum is taken with ``pmax`` first. Without head axes this is
    ``jax.nn.logsumexp``. The result carries no gradient through the maximum.
    """
    if not layout.heads:
        return jax.nn.logsumexp(x, axis=axis)
    m = jax.lax.pmax(jnp.max(x, axis=axis), layout.heads)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    total = jax.lax.psum(jnp.sum(jnp.exp(x - jnp.expand_dims(m, axis)), axis=axis), layout.heads)
    return m + jnp.log(total)


# ----------------------------------------------------------------------------------------------
# The ops' partitioned kernels

# sparse_mla on flattened batches: q [NB, S_q, H, D_qk], kv [NB, S_kv, D_qk],
# indices [NB, S_q, K], sink [H], lengths [NB, S_q].
SPARSE_MLA_FWD_ROLES = ("bsh.", "bt.", "bs.", "h", "bs")
SPARSE_MLA_FWD_RESULTS = (Result("bsh."), Result("bsh"), Result("bsh"))  # out, lse, max_logits
SPARSE_MLA_BWD_ROLES = SPARSE_MLA_FWD_ROLES + ("bsh.", "bsh", "bsh.")  # + out, lse, dout
# dq; dkv summed over the local heads and query rows; d_attn_sink over the local rows.
SPARSE_MLA_BWD_RESULTS = (Result("bsh."), Result("bT.", "h"), Result("h", "bs"))


def sparse_mla_forward(forward):
    """Decorates ``forward(q, kv, indices, sink, lengths, config) -> (out, lse, max_logits)``
    (flattened batch, any implementation) so that it partitions itself; ``lse`` and
    ``max_logits`` are per query and head, split like ``out``."""

    @functools.wraps(forward)
    def wrapped(q, kv, indices, sink, lengths, config):
        def local(layout, *a):
            return tuple(forward(*a, config))

        return partitioned_call(
            "sparse_mla", local, (q, kv, indices, sink, lengths), SPARSE_MLA_FWD_ROLES,
            SPARSE_MLA_FWD_RESULTS,
        )

    return wrapped


def sparse_mla_backward(bwd_rule):
    """Decorates the custom-VJP backward ``bwd_rule(config, residuals, cotangents) ->
    (dq, dkv, None, d_sink, None)`` so that it partitions itself; ``dkv`` is reduce-scattered
    over the sequence axes and summed over the head axes, ``d_sink`` summed over batch and
    sequence axes."""

    @functools.wraps(bwd_rule)
    def wrapped(config, residuals, cotangents):
        q, kv, indices, sink, lengths, out, lse = residuals
        dout = cotangents[0]

        def local(layout, q, kv, indices, sink, lengths, out, lse, dout):
            dq, dkv, _, dsink, _ = bwd_rule(
                config, (q, kv, indices, sink, lengths, out, lse), (dout, None, None)
            )
            return dq, dkv, dsink

        dq, dkv, dsink = partitioned_call(
            "sparse_mla backward", local, (q, kv, indices, sink, lengths, out, lse, dout),
            SPARSE_MLA_BWD_ROLES, SPARSE_MLA_BWD_RESULTS,
        )
        return _typed_like(dq, q), _typed_like(dkv, kv), None, _typed_like(dsink, sink), None

    return wrapped


def _typed_like(g, x):
    """``g`` typed like ``x``: a custom VJP must return each cotangent with its primal's type.

    Inside ``shard_map`` (``check_vma``) the type says over which manual axes a value varies:
    a cotangent varying where its primal does not is summed over those axes (the transpose of
    the broadcast; :func:`_varying_like` already made it vary wherever the primal does). On
    ``Explicit`` mesh axes the sharding is part of the type (e.g. ``d_attn_sink`` comes out
    split by head from a replicated ``attn_sink``): resharded."""
    extra = tuple(sorted(_varying(g) - _varying(x)))
    if extra:
        g = jax.lax.psum(g, extra)
    sharding = jax.typeof(x).sharding
    if AxisType.Explicit not in tuple(sharding.mesh.axis_types):
        return g
    if jax.typeof(g).sharding.spec == sharding.spec:
        return g
    return jax.sharding.reshard(g, sharding.spec)


def _present(args, roles):
    keep = tuple(i for i, x in enumerate(args) if x is not None)
    return tuple(args[i] for i in keep), tuple(roles[i] for i in keep), keep, len(args)


def _rebuild(flat, keep, n):
    full = [None] * n
    for i, x in zip(keep, flat):
        full[i] = x
    return full


# indexer_topk on flattened batches: q [NB, S_q, H_I, D_I], k [NB, S_kv, D_I],
# weights [NB, S_q, H_I], q_positions [NB, S_q], kv_positions [NB, S_kv], segment ids alike.
# Index heads are not split: every head shard computes the same top-k (Megatron-LM's
# "duplicated" indexer), so the selection is identical on all of them.
INDEXER_ROLES = ("bs..", "bt.", "bs.", "bs", "bt", "bs", "bt")


def indexer_topk(one, q, k, weights, q_pos, kv_pos, q_seg, kv_seg):
    """Partitioned ``jax.vmap(one)(q, k, weights, q_pos, kv_pos, q_seg, kv_seg)`` (segment ids
    may be ``None``): ``[NB, S_q, K]`` int32 global key indices."""
    flat, roles, keep, n = _present((q, k, weights, q_pos, kv_pos, q_seg, kv_seg), INDEXER_ROLES)

    def local(layout, *a):
        return (jax.vmap(one)(*_rebuild(a, keep, n)),)

    return partitioned_call("indexer_topk", local, flat, roles, (Result("bs."),))[0]


# indexer_kl_loss adds the main attention's q [NB, S_q, H, D_qk] (split by head), kv
# [NB, S_kv, D_qk] and the optional slots [NB, S_q, K].
KL_ROLES = INDEXER_ROLES + ("bsh.", "bt.", "bs.")
KL_RESULTS = (Result("b", "s"), Result("b", "s"))  # per batch element: KL sum, row count
KL_GRAD_RESULTS = (Result("bs.."), Result("bT."), Result("bs."))  # d index_q, index_k, weights


def indexer_kl_loss(one, index_q, index_k, index_weights, q_pos, kv_pos, q_seg, kv_seg, q, kv,
                    indices, roles=KL_ROLES):
    """Partitioned, differentiable ``jax.vmap(one(layout))(...)`` of the indexer KL loss.

    ``one(layout)`` returns the per-batch-element function ``(index_q, index_k, index_weights,
    q_pos, kv_pos, q_seg, kv_seg, q, kv, indices) -> (kl_sum, row_count)``; with heads split it
    must sum the target's head mean across ``layout.heads`` (see :func:`head_logsumexp`).
    Returns ``(kl_sum [NB], row_count [NB])``. Gradients reach ``index_q``, ``index_k`` and
    ``index_weights`` only (``q`` and ``kv`` are the detached target).
    """
    return _kl(one, roles, index_q, index_k, index_weights, q_pos, kv_pos, q_seg, kv_seg, q, kv,
               indices)


# DeepSeek V4's loss adds the main attention's log denominator attention_lse [NB, S_q, H]
# (split by head, like q) before the slots.
V4_KL_ROLES = KL_ROLES[:-1] + ("bsh", "bs.")


def v4_indexer_kl_loss(one, index_q, index_k, index_weights, q_pos, kv_pos, q_seg, kv_seg, q,
                       kv, attention_lse, indices):
    """:func:`indexer_kl_loss` for DeepSeek V4's loss (``one`` also takes ``attention_lse``)."""
    return _kl(one, V4_KL_ROLES, index_q, index_k, index_weights, q_pos, kv_pos, q_seg, kv_seg,
               q, kv, attention_lse, indices)


def _kl_local(one, keep, n):
    def local(layout, *a):
        return tuple(jax.vmap(one(layout))(*_rebuild(a, keep, n)))

    return local


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kl(one, all_roles, *args):
    flat, roles, keep, n = _present(args, all_roles)
    return partitioned_call("indexer_kl_loss", _kl_local(one, keep, n), flat, roles, KL_RESULTS)


def _kl_fwd(one, all_roles, *args):
    return _kl(one, all_roles, *args), args


def _kl_bwd(one, all_roles, args, cotangents):
    g = cotangents[0]
    flat, roles, keep, n = _present(args, all_roles)

    def local(layout, g, iq, ik, iw, *rest):
        f = _kl_local(one, keep, n)

        def kl_of(iq, ik, iw):
            return f(layout, iq, ik, iw, *rest)[0]

        _, vjp = jax.vjp(kl_of, iq, ik, iw)
        return vjp(g)

    grads = partitioned_call(
        "indexer_kl_loss backward", local, (g,) + flat, ("b",) + roles, KL_GRAD_RESULTS
    )
    grads = tuple(_typed_like(gr, x) for gr, x in zip(grads, args))
    return grads + (None,) * (len(args) - 3)


_kl.defvjp(_kl_fwd, _kl_bwd)
