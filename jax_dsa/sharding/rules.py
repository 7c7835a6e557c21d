"""Logical axis names -> mesh axes: the default rules table and the lookup.

The layers in :mod:`jax_dsa.nn` name every parameter and activation dim with a logical axis
(``batch``, ``sequence``, ``heads``, ...; see :data:`jax_dsa.nn.layers.LOGICAL_AXES`). A rules
table maps each logical name to a mesh axis (or ``None``: not split). The default table, for a
mesh with axes ``dp`` (data), ``ep`` (experts), ``cp`` (context) and ``tp`` (tensor):

=================  =======  =========================================================
logical axis       mesh     why
=================  =======  =========================================================
``batch``          ``dp``,  data parallel (the expert-parallel devices too: each holds
                   ``ep``   other tokens)
``experts``        ``ep``   expert parallel: each device holds ``E / ep`` routed experts,
                            tokens move by all-to-all (:mod:`.expert_dispatch`)
``sequence``       ``cp``   context parallel: activations split by token; the DSA ops
                            gather keys along the sequence and keep queries local
``heads``          ``tp``   tensor parallel over attention heads (q, out, lse, dq)
``mlp``            ``tp``   the SwiGLU hidden dim (Megatron-LM column/row split)
``vocab``          ``tp``   embedding table and LM head split by vocabulary
``index_heads``    ``None`` the indexer is duplicated on every tensor shard, so its
                            top-k is identical on all of them (Megatron-LM's DSA)
everything else    ``None`` ``embed``, ``q_lora``, ``kv_lora``, ``index_head_dim``
=================  =======  =========================================================

A rule's mesh axes that the mesh lacks are left out, and of the rest the longest leading part
whose size divides the dim is used (none if even the first does not), so one table serves
every mesh (``dp=8`` alone, ``dp=2,cp=2,tp=2``, ``ep=8``, ...). To fold expert parallelism
over the data- or context-parallel devices without an ``ep`` axis, map ``experts`` to them
(``("experts", ("dp", "cp"))``: prime-rl's cp 8 x ep 8 on 8 GPUs).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

from jax.sharding import PartitionSpec as P

# Mesh axis names, in the order the example builds meshes (tensor parallel innermost: the
# fastest links carry the most traffic).
DATA, EXPERT, CONTEXT, TENSOR = "dp", "ep", "cp", "tp"
MESH_AXES = (DATA, EXPERT, CONTEXT, TENSOR)

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # ep devices are data parallel for everything but the routed experts (as Megatron-LM and
    # the PyTorch trainers fold expert parallelism over the data-parallel ranks)
    ("batch", (DATA, EXPERT)),
    ("sequence", CONTEXT),
    ("heads", TENSOR),
    ("mlp", TENSOR),
    ("vocab", TENSOR),
    ("index_heads", None),
    ("index_head_dim", None),
    ("embed", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("experts", EXPERT),
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

    A mesh axis is used at most once per array (the first dim that claims it wins); a rule's
    axes the mesh lacks are left out, and a rule is cut to its longest leading part that
    divides the dim.

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
        if sizes is not None:  # a rule's axes that the mesh lacks are left out
            axes = tuple(a for a in axes if a in sizes)
        if any(a in used for a in axes):
            axes = ()
        if shape is not None and sizes is not None:
            # the longest leading part of the rule that divides the dim (batch 2 on dp=2, ep=4
            # splits over dp only)
            while axes and shape[d] % math.prod(sizes[a] for a in axes):
                axes = axes[:-1]
        used.update(axes)
        spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    return P(*spec)
