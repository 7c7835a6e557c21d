"""One helper for activation sharding constraints by logical axis names.

``constrain(x, ("batch", "sequence", "embed"))`` maps the names through the rules in effect
(:func:`jax_dsa.sharding.rules.current_rules`) onto the mesh in context (``jax.set_mesh``):

* ``Auto`` mesh axes: ``jax.lax.with_sharding_constraint`` (a hint the partitioner follows);
* ``Explicit`` mesh axes: ``jax.sharding.reshard`` (the sharding is part of the type);
* no mesh, or inside ``shard_map`` (``Manual`` axes): ``x`` unchanged.

Pattern: MaxText's ``maybe_shard_with_logical`` (hint in auto mode, enforce in explicit mode).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.sharding.rules import logical_to_spec


def _only(spec: P, keep) -> P:
    out = []
    for e in spec:
        axes = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        axes = tuple(a for a in axes if a in keep)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*out)


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
