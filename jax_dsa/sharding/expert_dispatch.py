"""Expert parallelism's token exchange: the (token, slot) pairs of each device sent to the
devices that hold their experts, and the experts' outputs sent back (inside ``shard_map``).

The routed experts ``[E, ...]`` are split over the ``ep`` group (one or more mesh axes, ``n``
devices): device ``d`` holds experts ``[d * E / n, (d + 1) * E / n)``. Each device sorts its
pairs by expert (so the rows for each destination are contiguous, and within it sorted by
expert), then:

1. :func:`plan` (a pure function of the pair counts of the whole group, ``[n, E]``, all-gathered:
   ``4 n E`` bytes) gives every offset and size both exchanges need;
2. :func:`dispatch` moves the rows: ``"ragged"`` (``jax.lax.ragged_all_to_all``: exactly the
   rows, into a receive buffer of static size) or ``"capacity"`` (``jax.lax.all_to_all`` of a
   ``[n, C, H]`` buffer: ``C`` rows per (source, destination) block, padding included);
3. :func:`receive_keys`: each received row's local expert (``E / n`` for padding), by which the
   caller sorts them for the grouped matmuls;
4. :func:`combine` moves the results back to the rows they came from (dropped or never-sent rows
   come back zero).

Pairs that do not fit a capped buffer are dropped deterministically and counted in
:attr:`Plan.overflow`: ``"capacity"`` keeps the first ``C`` rows of each (source, destination)
block; ``"ragged"`` shares each destination's ``R`` rows among the sources max-min fairly (every
source keeps ``min(its rows, L)``, ``L`` the largest level that fits), so no source is always
the one cut; within a block the last rows in expert order go. By default the buffers hold the
dropless worst case, so nothing is dropped. XLA:CPU has no ``ragged-all-to-all`` (jax 0.11.2),
so the host runs ``"capacity"``; both modes share :func:`plan` and :func:`receive_keys`.

Every permutation is a gather in both directions (:func:`gather_rows`; the all-to-alls are their
own transposes, ``ragged_all_to_all``'s transpose is the reverse ragged exchange), so the
backward is as deterministic as the forward: no scatter-add.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

MODES = ("ragged", "capacity")


class Plan(NamedTuple):
    """One device's view of the exchange (all int32; ``n`` the group size, ``E_l = E / n``).

    send_counts [n]: this device's pairs for each destination (before any capacity cut);
    send_offsets [n]: where they start in its expert-sorted pairs;
    send_sizes [n]: how many it sends (kept);
    remote_offsets [n]: where they land in each destination's receive buffer;
    recv_offsets [n], recv_sizes [n]: where each source's rows land here, how many;
    home_offsets [n]: where this device's rows start in each source's sorted pairs (the way
      back's output offsets);
    recv_expert_sizes [n, E_l]: rows received from each source for each local expert;
    overflow []: this device's pairs that were dropped.
    """

    send_counts: jax.Array
    send_offsets: jax.Array
    send_sizes: jax.Array
    remote_offsets: jax.Array
    recv_offsets: jax.Array
    recv_sizes: jax.Array
    home_offsets: jax.Array
    recv_expert_sizes: jax.Array
    overflow: jax.Array


def _exclusive_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis) - a


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"expert dispatch: mode must be one of {MODES}, got {mode!r}")


def _fair_level(total, rows):
    """``[n]``: for each destination (column of ``total [source, destination]``) the largest
    ``L`` with ``sum_s min(total[s], L) <= rows`` (the sum itself where it fits). With the
    column sorted, ``a[0] <= ... <= a[n-1]``, and ``P_k = a[0] + ... + a[k-1]``, each
    ``min(a[k], (rows - P_k) // (n - k))`` is such a level, and the largest of them is the
    largest one. Integer arithmetic throughout (no product that can overflow int32)."""
    n = total.shape[0]
    a = jnp.sort(total, axis=0)
    below = _exclusive_cumsum(a, 0)
    share = (rows - below) // (n - jnp.arange(n, dtype=jnp.int32))[:, None]
    return jnp.minimum(a, share).max(0)


def buffer_rows(pairs: int, n: int, mode: str, capacity_factor: float | None = None) -> int:
    """Static receive-buffer size for ``pairs`` (token, slot) pairs per device and a group of
    ``n``: ``"capacity"``: rows per (source, destination) block ``C``; ``"ragged"``: rows of the
    whole receive buffer ``R``. ``capacity_factor=None``: the dropless worst case (``C = pairs``:
    one source may send all its pairs to one device; ``R = n * pairs``); else ``factor`` times
    the balanced share (``C = ceil(f * pairs / n)``, ``R = ceil(f * pairs)``), at least 1 and
    at most the worst case.

    The same ``f`` caps differently in the two modes: ``"capacity"`` per (source, destination)
    block, ``"ragged"`` per destination (shared by the sources), so a skewed routing drops
    fewer pairs in ``"ragged"``.

    Raises:
      ValueError: an unknown ``mode`` or a ``capacity_factor`` that is not a finite number > 0.
    """
    _check_mode(mode)
    worst = pairs if mode == "capacity" else n * pairs
    if capacity_factor is None:
        return max(worst, 1)
    if not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"expert dispatch: capacity_factor must be a finite number > 0, got "
                         f"{capacity_factor}")
    share = pairs / n if mode == "capacity" else pairs
    return max(1, min(worst, math.ceil(capacity_factor * share)))


def plan(counts, me, *, mode: str, rows: int) -> Plan:
    """Offsets and sizes of both exchanges for device ``me`` of the group.

    Args:
      counts: ``[n, E]`` int, pairs per (source device, global expert), the same on every device
        of the group (all-gathered); ``E`` divisible by ``n``.
      me: this device's index in the group (int scalar, may be traced).
      mode: ``"ragged"`` or ``"capacity"``.
      rows: :func:`buffer_rows`: ``C`` per block (``"capacity"``) or ``R`` per receive buffer
        (``"ragged"``; an over-full buffer is shared max-min fairly among the sources).

    Returns:
      :class:`Plan`. A pure function of its inputs (plain ``jnp``): the unit tests check it
      against numpy on the host, the ragged mode included.

    Raises:
      ValueError: ``counts`` not ``[n, E]`` with ``n`` dividing ``E``, or an unknown ``mode``.
    """
    _check_mode(mode)
    counts = jnp.asarray(counts, jnp.int32)
    if counts.ndim != 2 or counts.shape[1] % counts.shape[0]:
        raise ValueError(f"expert dispatch: counts must be [n, E] with n dividing E, got "
                         f"{counts.shape}")
    n, e = counts.shape
    by_expert = counts.reshape(n, n, e // n)  # [source, destination, local expert]
    total = by_expert.sum(-1)  # [source, destination]
    if mode == "capacity":
        kept = jnp.minimum(total, rows)
    else:
        kept = jnp.minimum(total, _fair_level(total, rows)[None, :])
    # within a block the first `kept` rows in expert order go
    cum = jnp.minimum(jnp.cumsum(by_expert, axis=-1), kept[..., None])
    kept_by_expert = cum - jnp.concatenate(
        [jnp.zeros((n, n, 1), jnp.int32), cum[..., :-1]], axis=-1)
    if mode == "capacity":
        recv_offsets = jnp.arange(n, dtype=jnp.int32) * rows
        remote_offsets = jnp.full((n,), me * rows, jnp.int32)
    else:
        recv_offsets = _exclusive_cumsum(kept[:, me], 0)
        remote_offsets = _exclusive_cumsum(kept, 0)[me]
    return Plan(
        send_counts=total[me],
        send_offsets=_exclusive_cumsum(total[me], 0),
        send_sizes=kept[me],
        remote_offsets=remote_offsets,
        recv_offsets=recv_offsets,
        recv_sizes=kept[:, me],
        home_offsets=_exclusive_cumsum(total, 1)[:, me],
        recv_expert_sizes=kept_by_expert[:, me],
        overflow=(total[me] - kept[me]).sum(),
    )


def receive_keys(p: Plan, rows: int):
    """``[rows]`` int32: the local expert of each row of the receive buffer (``rows`` long), or
    ``E_l`` for a row that holds nothing (padding sorts last). Each source's rows start at
    ``recv_offsets`` and come sorted by local expert."""
    n, el = p.recv_expert_sizes.shape
    starts = (p.recv_offsets[:, None] + _exclusive_cumsum(p.recv_expert_sizes, 1)).reshape(-1)
    ends = starts + p.recv_expert_sizes.reshape(-1)
    r = jnp.arange(rows, dtype=jnp.int32)
    # blocks are ordered and disjoint: the first block ending after r holds r if it starts at
    # or before r (empty blocks end where they start, so they are skipped)
    block = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)
    inside = (block < n * el) & (r >= starts[jnp.minimum(block, n * el - 1)])
    return jnp.where(inside, block % el, el).astype(jnp.int32)


@jax.custom_vjp
def gather_rows(a, idx, valid, inverse, inverse_valid):
    """``where(valid, a[idx], 0)`` (``[len(idx), ...]``) for a one-to-one map between the valid
    entries: output row ``j`` reads ``a[idx[j]]`` exactly when ``a``'s row ``idx[j]`` names
    ``j`` back (``inverse[idx[j]] == j``, ``inverse_valid`` there). Backward:
    ``where(inverse_valid, d[inverse], 0)``, a gather where autodiff would scatter-add."""
    return _masked(a[idx], valid)


def _masked(rows, valid):
    return jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 1)), rows,
                     jnp.zeros((), rows.dtype))


def _gather_rows_fwd(a, idx, valid, inverse, inverse_valid):
    return gather_rows(a, idx, valid, inverse, inverse_valid), (inverse, inverse_valid)


def _gather_rows_bwd(res, d):
    inverse, inverse_valid = res
    return _masked(d[inverse], inverse_valid), None, None, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def _block_maps(p: Plan, pairs: int, capacity: int):
    """The ``"capacity"`` buffer's row maps: buffer row ``(j, c)`` <- pair ``send_offsets[j] +
    c`` (valid while ``c < send_sizes[j]``), and pair ``r`` -> buffer row ``j(r) * C + c(r)``."""
    n = p.send_sizes.shape[0]
    slot = jnp.arange(n * capacity, dtype=jnp.int32)
    dest, c = slot // capacity, slot % capacity
    to_buffer = (jnp.minimum(p.send_offsets[dest] + c, max(pairs - 1, 0)),
                 c < p.send_sizes[dest])
    r = jnp.arange(pairs, dtype=jnp.int32)
    j = jnp.minimum(jnp.searchsorted(jnp.cumsum(p.send_counts), r, side="right"), n - 1)
    c = r - p.send_offsets[j]
    to_pairs = (j * capacity + jnp.minimum(c, capacity - 1), c < p.send_sizes[j])
    return to_buffer, to_pairs


def dispatch(xs, p: Plan, *, axis, mode: str, rows: int):
    """This device's pairs ``xs [pairs, H]`` (sorted by expert) to the devices of their experts.

    Args:
      xs: ``[pairs, H]``; p: :func:`plan`'s; axis: the group's mesh axis name(s) (Manual: call
        inside ``shard_map``); mode, rows: as given to :func:`plan`.

    Returns:
      the receive buffer: ``[rows, H]`` (``"ragged"``) or ``[n * rows, H]`` (``"capacity"``,
      source ``i``'s block at ``i * rows``), laid out as :func:`receive_keys` reads it.
    """
    _check_mode(mode)
    if mode == "ragged":
        out = jnp.zeros((rows,) + xs.shape[1:], xs.dtype)
        return jax.lax.ragged_all_to_all(xs, out, p.send_offsets, p.send_sizes,
                                         p.remote_offsets, p.recv_sizes, axis_name=axis)
    to_buffer, to_pairs = _block_maps(p, xs.shape[0], rows)
    buf = gather_rows(xs, *to_buffer, *to_pairs)
    return jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)


def combine(ys, p: Plan, *, axis, mode: str, pairs: int):
    """The way back: the receive buffer's results ``ys`` (laid out as :func:`dispatch` returned
    them) to the devices and rows they came from: ``[pairs, H]`` in the sender's expert-sorted
    order; pairs that were dropped come back zero."""
    _check_mode(mode)
    if mode == "ragged":
        out = jnp.zeros((pairs,) + ys.shape[1:], ys.dtype)
        return jax.lax.ragged_all_to_all(ys, out, p.recv_offsets, p.recv_sizes,
                                         p.home_offsets, p.send_sizes, axis_name=axis)
    rows = ys.shape[0] // p.send_sizes.shape[0]
    back = jax.lax.all_to_all(ys, axis, 0, 0, tiled=True)
    to_buffer, to_pairs = _block_maps(p, pairs, rows)
    return gather_rows(back, *to_pairs, *to_buffer)


def default_mode(mesh=None) -> str:
    """``"ragged"`` where XLA implements ``ragged-all-to-all`` (GPU, TPU), ``"capacity"`` on the
    host (XLA:CPU does not, jax 0.11.2), by the platform of ``mesh``'s devices (default: the
    mesh in context; without one, JAX's default backend)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if isinstance(mesh, jax.sharding.Mesh):
        platform = mesh.devices.flat[0].platform
    else:  # an abstract mesh knows its devices' kind once devices made it
        platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    platform = platform or jax.default_backend()
    return "capacity" if platform == "cpu" else "ragged"


__all__ = [
    "MODES", "Plan", "buffer_rows", "combine", "default_mode", "dispatch", "gather_rows", "plan",
    "receive_keys",
]
