"""Logical axis names -> mesh axes: the default rules table and the lookup.

The layers in :mod:`jax_dsa.nn` name every parameter and activation dim with a logical axis
(``batch``, ``sequence``, ``heads``, ...; see :data:`jax_dsa.nn.layers.LOGICAL_AXES`). A rules
table maps each logical name to a mesh axis (or ``None``: not split). The default table, for a
mesh with axes ``dp`` (data), ``cp`` (context) and ``tp`` (tensor):

=================  =======  =========================================================
logical axis       mesh     why
=================  =======  =========================================================
``batch``          ``dp``   data parallel
``sequence``       ``cp``   context parallel: activations split by token; the DSA ops
                            gather keys along the sequence and keep queries local
``heads``          ``tp``   tensor parallel over attention heads (q, out, lse, dq)
``mlp``            ``tp``   the SwiGLU hidden dim (Megatron-LM column/row split)
``vocab``          ``tp``   embedding table and LM head split by vocabulary
``index_heads``    ``None`` the indexer is duplicated on every tensor shard, so its
                            top-k is identical on all of them (Megatron-LM's DSA)
everything else    ``None`` ``embed``, ``q_lora``, ``kv_lora``, ``index_head_dim``,
                            ``experts`` (no expert parallelism yet)
=================  =======  =========================================================

A rule naming a mesh axis that the mesh lacks, or whose size does not divide the dim, is
skipped, so one table serves every mesh (``dp=8`` alone, ``dp=2,cp=2,tp=2``, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

from jax.sharding import PartitionSpec as P

# Mesh axis names, in the order the example builds meshes (tensor parallel innermost: the
# fastest links carry the most traffic).
DATA, CONTEXT, TENSOR = "dp", "cp", "tp"
MESH_AXES = (DATA, CONTEXT, TENSOR)

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA),
    ("sequence", CONTEXT),
    ("heads", TENSOR),
    ("mlp", TENSOR),
    ("vocab", TENSOR),
    ("index_heads", None),
    ("index_head_dim", None),
    ("embed", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("experts", None),
)

_RULES: contextvars.ContextVar = contextvars.ContextVar("jax_dsa_axis_rules", default=None)


def current_rules() -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """The rules in effect: the innermost :func:`axis_rules`'s, else :data:`DEFAULT_RULES`."""
    rules = _RULES.get()
    return DEFAULT_RULES if rules is None else rules


@contextlib.contextmanager
def axis_rules(rules):
    """Use ``rules`` (``((logical, mesh_axis_or_None), ...)``) for the layers' activation
    constraints inside the ``with`` block (while tracing)."""
    rules = tuple((str(k), v) for k, v in rules)
    token = _RULES.set(rules)
    try:
        yield rules
    finally:
        _RULES.reset(token)


def logical_to_spec(logical_axes, rules=None, mesh=None, shape=None) -> P:
    """PartitionSpec for a tuple of logical axis names (``None`` entries stay unsplit).

    Args:
      logical_axes: one logical name (or ``None``) per dim.
      rules: the table (default :func:`current_rules`).
      mesh: a ``Mesh``/``AbstractMesh``; rules naming axes it lacks are skipped.
      shape: the array's shape; a rule whose mesh axes do not divide the dim is skipped.

    A mesh axis is used at most once per array (the first dim that claims it wins).

    Raises:
      ValueError: ``shape`` given with a different length than ``logical_axes``.
    """
    table = dict(current_rules() if rules is None else rules)
    logical_axes = tuple(logical_axes or ())
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical_to_spec: {len(logical_axes)} axis names for shape {shape}")
    sizes = dict(mesh.shape) if mesh is not None else None
    used, spec = set(), []
    for d, name in enumerate(logical_axes):
        target = table.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        if sizes is not None and any(a not in sizes for a in axes):
            axes = ()
        if any(a in used for a in axes):
            axes = ()
        if axes and shape is not None and sizes is not None:
            if shape[d] % math.prod(sizes[a] for a in axes):
                axes = ()
        used.update(axes)
        spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*spec)
