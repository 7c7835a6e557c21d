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
(``cp_comm_type=allgather``) and NVIDIA TransformerEngine's ``FusedAttnCPWithAllGather``.
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
      args: the operands (arrays, or ``None`` for an absent optional operand: ``local`` gets
        ``None`` in its place).
      roles: one role string per operand (any string for a ``None`` operand).
      results: one :class:`Result` per output of ``local``.

    Raises:
      ValueError: role strings that do not fit the operands.
    """
    args, roles, results = tuple(args), tuple(roles), tuple(results)
    if len(args) != len(roles):
        raise ValueError(f"{name}: {len(args)} operands but {len(roles)} role strings")
    if any(x is None for x in args):  # drop absent operands; give local None in their place
        keep = tuple(i for i, x in enumerate(args) if x is not None)
        n, inner = len(args), local

        def local(layout, *present):
            full = [None] * n
            for i, x in zip(keep, present):
                full[i] = x
            return inner(layout, *full)

        args, roles = tuple(args[i] for i in keep), tuple(roles[i] for i in keep)
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


def typed_like(g, x):
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
