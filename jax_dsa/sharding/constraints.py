"""One helper for activation sharding constraints by logical axis names.

``constrain(x, ("batch", "sequence", "embed"))`` maps the names through the rules in effect
(:func:`jax_dsa.sharding.rules.current_rules`) onto the mesh in context (``jax.set_mesh``):

* ``Auto`` mesh axes: ``jax.lax.with_sharding_constraint`` (a hint the partitioner follows);
* ``Explicit`` mesh axes: ``jax.sharding.reshard`` (the sharding is part of the type);
* no mesh, or inside ``shard_map`` (``Manual`` axes): ``x`` unchanged.

Pattern: MaxText's ``maybe_shard_with_logical`` (hint in auto mode, enforce in explicit mode).

On ``Explicit`` axes JAX also wants the result sharding of a gather, of a contraction over a
split dim and of some reshapes spelled out; the layers use :func:`explicit_axes`,
:func:`typed_spec`, :func:`out_spec`, :func:`dividing`, :func:`whole` and :func:`matching` for
that.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.sharding.rules import logical_to_spec


def _axes(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _only(spec: P, keep) -> P:
    out = []
    for e in spec:
        axes = tuple(a for a in _axes(e) if a in keep)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*out)


def _size(mesh, axes) -> int:
    """Number of shards along the mesh axes ``axes``."""
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return n


def explicit_axes() -> frozenset[str]:
    """Names of the ``Explicit`` axes of the mesh in context (empty without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return frozenset()
    return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                     if t == AxisType.Explicit)


def check_split(count: int, logical: str, what: str, *,
                axis_types=(AxisType.Auto, AxisType.Explicit)) -> None:
    """Checks that the mesh axes (of ``axis_types``) the rules map ``logical`` to divide
    ``count``, on the mesh in context; nothing to check without one, or inside ``shard_map``
    (any ``Manual`` axis: :func:`constrain` leaves activations alone there too).

    The layers fuse such a count with another dim in their weights (``heads`` x ``head_dim``),
    so the lookup's skip rule cannot see that the count itself does not split.

    Raises:
      ValueError: naming ``what``, the mesh axes and the rule to change.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Manual in mesh.axis_types:
        return
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    axes = tuple(a for a in _axes(logical_to_spec((logical,), mesh=mesh)[0])
                 if kinds[a] in axis_types)
    n = _size(mesh, axes)
    if count % n:
        raise ValueError(
            f"{what} = {count} does not split over mesh axes {axes} (size {n}), which the "
            f"logical-axis rules map {logical!r} to: use a mesh whose {axes} size divides "
            f"{what}, or map {logical!r} to None (jax_dsa.sharding.axis_rules)")


def typed_spec(x) -> tuple:
    """Per-dim entries of ``x``'s sharding type (``None`` padded to ``x.ndim``)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def dividing(entry, size: int):
    """``entry`` (one PartitionSpec entry) if its mesh axes' sizes divide ``size``, else None."""
    return entry if size % _size(jax.sharding.get_abstract_mesh(), _axes(entry)) == 0 else None


def whole(x, *dims: int):
    """``x`` resharded so that ``dims`` are not split over ``Explicit`` mesh axes (an
    all-gather along them); unchanged without Explicit axes or when already whole."""
    if x is None or not explicit_axes():
        return x
    spec = list(typed_spec(x))
    if all(spec[d] is None for d in dims):
        return x
    for d in dims:
        spec[d] = None
    return jax.sharding.reshard(x, P(*spec))


def matching(x, dim: int, ref, ref_dim: int):
    """``x`` resharded so that its ``dim`` splits like ``ref``'s ``ref_dim`` (on ``Explicit``
    axes, where a contraction's batch dims must agree); unchanged otherwise."""
    if not explicit_axes():
        return x
    spec, want = list(typed_spec(x)), typed_spec(ref)[ref_dim]
    if spec[dim] == want:
        return x
    spec[dim] = want
    return jax.sharding.reshard(x, P(*spec))


def out_spec(lead: tuple, *trailing) -> P:
    """``P(*lead, *trailing)`` with every trailing entry that reuses a mesh axis of ``lead``
    (or of an earlier trailing entry) dropped to ``None``: the ``out_sharding`` of a gather or
    a contraction on ``Explicit`` axes, where JAX does not pick one itself."""
    used = {a for e in lead for a in _axes(e)}
    out = []
    for e in trailing:
        if set(_axes(e)) & used:
            e = None
        used |= set(_axes(e))
        out.append(e)
    return P(*lead, *out)


def constrain(x, logical_axes, rules=None):
    """``x`` with its sharding constrained to the logical axes (one name or ``None`` per dim).

    Args:
      x: an array.
      logical_axes: tuple of logical axis names, ``len == x.ndim``.
      rules: rules table (default: the one in effect).

    Raises:
      ValueError: ``len(logical_axes) != x.ndim``.
    """
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} axis names for an array of shape "
                         f"{x.shape}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if AxisType.Manual in types.values():
        return x
    spec = logical_to_spec(logical_axes, rules, mesh, x.shape)
    explicit = {a for a, t in types.items() if t == AxisType.Explicit}
    auto = {a for a, t in types.items() if t == AxisType.Auto}
    if explicit:
        x = jax.sharding.reshard(x, _only(spec, explicit))
    if auto:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, _only(spec, auto)))
    return x
