"""Expert parallelism's exchange plan (jax_dsa.sharding.expert_dispatch) against numpy.

The plan is a pure function of the group's pair counts, shared by the ``"ragged"`` and the
``"capacity"`` exchanges. XLA:CPU has no ragged all-to-all, so here the exchanges are replayed
in numpy from every device's plan, following ``jax.lax.ragged_all_to_all``'s documented
semantics (and ``all_to_all``'s), and each row is followed to its expert and back: rows land on
the device of their expert, sorted by :func:`receive_keys` to the right local expert, come home
to the row they left, and exactly the pairs that a capped buffer cannot hold are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa.sharding import expert_dispatch as ed


def _counts(rng, n, e, pairs):
    """[n, e]: each device's ``pairs`` pairs over the experts; the last expert and device 1's
    experts get none, device 0 sends all its pairs to device n-1."""
    el = e // n
    counts = np.zeros((n, e), np.int64)
    for i in range(n):
        allowed = [x for x in range(e - 1) if x // el != 1 and (i or x // el == n - 1)]
        counts[i] = np.bincount(rng.choice(allowed, pairs), minlength=e)
    return counts


def _replay(counts, mode, rows):
    """Every device's plan, the rows moved as the collectives would, numpy-side. Returns
    ``(plans, buffers, sent, home)``: the receive buffers (label per row: (source, expert,
    serial) or -1), each source's sorted pairs' labels, and its rows as they come back (the
    label, or -1 when dropped)."""
    n, e = counts.shape
    plans = [jax.tree.map(np.asarray, ed.plan(counts, i, mode=mode, rows=rows))
             for i in range(n)]
    # sorted pairs of device i: (i, expert, serial) labels, by expert
    sent = [np.array([(i, x, s) for x in range(e) for s in range(counts[i, x])]).reshape(-1, 3)
            for i in range(n)]
    size = rows if mode == "ragged" else n * rows
    buffers = [np.full((size, 3), -1) for _ in range(n)]
    for i, p in enumerate(plans):
        for j in range(n):
            start, count = p.send_offsets[j], p.send_sizes[j]
            at = p.remote_offsets[j] if mode == "ragged" else i * rows
            if mode == "ragged":  # the receiver's own view must agree (ragged_all_to_all's rule)
                assert plans[j].recv_offsets[i] == at and plans[j].recv_sizes[i] == count
            buffers[j][at:at + count] = sent[i][start:start + count]
    home = [np.full((len(s), 3), -1) for s in sent]
    for j, p in enumerate(plans):
        for i in range(n):
            start, count = p.recv_offsets[i], p.recv_sizes[i]
            at = p.home_offsets[i]
            assert at == plans[i].send_offsets[j]
            home[i][at:at + count] = buffers[j][start:start + count]
    return plans, buffers, sent, home


def _kept_reference(counts, mode, rows):
    """numpy: which (source, expert, serial) pairs fit. capacity: the first ``rows`` of each
    (source, destination) block in expert order; ragged: each source keeps the first
    ``min(its rows, L)`` of its block for a destination, ``L`` the largest level (searched
    one by one) at which the destination's ``rows`` hold them all."""
    n, e = counts.shape
    el = e // n
    total = counts.reshape(n, n, el).sum(-1)  # [source, destination]
    kept = set()
    for j in range(n):
        level = rows
        if mode == "ragged":
            level = max(lv for lv in range(rows + 1) if np.minimum(total[:, j], lv).sum() <= rows)
        for i in range(n):
            left = level
            for x in range(j * el, (j + 1) * el):
                for s in range(counts[i, x]):
                    if left > 0:
                        kept.add((i, x, s))
                        left -= 1
    return kept


@pytest.mark.parametrize("mode", ed.MODES)
@pytest.mark.parametrize("factor", [None, 0.5])
def test_plan_moves_every_row_to_its_expert_and_back(mode, factor):
    rng = np.random.default_rng(0)
    n, e, pairs = 4, 16, 24
    counts = _counts(rng, n, e, pairs)
    rows = ed.buffer_rows(pairs, n, mode, factor)
    plans, buffers, sent, home = _replay(counts, mode, rows)
    kept = _kept_reference(counts, mode, rows)
    el = e // n
    for j, (p, buf) in enumerate(zip(plans, buffers)):
        keys = np.asarray(ed.receive_keys(jax.tree.map(jnp.asarray, p), len(buf)))
        filled = buf[:, 0] >= 0
        # each received row is one of this device's experts' and the keys name it
        np.testing.assert_array_equal(keys[filled], buf[filled, 1] - j * el)
        assert (keys[~filled] == el).all()
        assert {tuple(r) for r in buf[filled]} == {k for k in kept if k[1] // el == j}
        np.testing.assert_array_equal(p.recv_expert_sizes.sum(0),
                                      np.bincount(buf[filled, 1] - j * el, minlength=el))
    for i in range(n):
        back = home[i][:, 0] >= 0
        np.testing.assert_array_equal(home[i][back], sent[i][back])  # to the row it left
        assert {tuple(r) for r in sent[i][back]} == {k for k in kept if k[0] == i}
        assert plans[i].overflow == len(sent[i]) - back.sum()
    dropped = sum(int(p.overflow) for p in plans)
    assert dropped == counts.sum() - len(kept)
    assert (dropped == 0) == (factor is None)  # the default buffers are dropless


def test_buffer_rows_and_errors():
    assert ed.buffer_rows(24, 4, "capacity") == 24  # one source may send all to one device
    assert ed.buffer_rows(24, 4, "ragged") == 96
    assert ed.buffer_rows(24, 4, "capacity", 1.0) == 6
    assert ed.buffer_rows(24, 4, "ragged", 1.25) == 30
    assert ed.buffer_rows(24, 4, "capacity", 100.0) == 24  # never past the worst case
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            ed.buffer_rows(24, 4, "capacity", bad)
    with pytest.raises(ValueError, match="mode must be one of"):
        ed.plan(np.zeros((2, 4), np.int32), 0, mode="dense", rows=4)
    with pytest.raises(ValueError, match=r"counts must be \[n, E\] with n dividing E"):
        ed.plan(np.zeros((3, 4), np.int32), 0, mode="ragged", rows=4)


def test_gather_rows_backward_is_the_inverse_gather():
    """A masked map and its inverse: the gradient is the inverse gather (no scatter-add),
    equal to autodiff's."""
    a = jnp.arange(12.0).reshape(6, 2)
    idx, valid = jnp.array([4, 0, 5, 2]), jnp.array([True, True, False, True])
    inv = jnp.array([1, 0, 3, 0, 0, 2])
    inv_valid = jnp.array([True, False, True, False, True, False])
    d = jnp.arange(8.0).reshape(4, 2) + 1
    got = jax.grad(lambda a: (ed.gather_rows(a, idx, valid, inv, inv_valid) * d).sum())(a)
    want = jax.grad(lambda a: (jnp.where(valid[:, None], a[idx], 0) * d).sum())(a)
    np.testing.assert_array_equal(got, want)


def test_ragged_cut_is_max_min_fair():
    """An over-full ragged buffer is shared max-min fairly, whatever the sources' order: device
    0 receives 10, 1, 3, 10 pairs from sources 0-3 into 12 rows: each keeps min(its pairs, 4)."""
    counts = np.zeros((4, 4), np.int32)  # one expert per device
    counts[:, 0] = [10, 1, 3, 10]
    counts[:, 1] = [2, 2, 2, 2]
    kept = [int(ed.plan(counts, i, mode="ragged", rows=12).send_sizes[0]) for i in range(4)]
    assert kept == [4, 1, 3, 4]
    assert int(ed.plan(counts, 0, mode="ragged", rows=12).recv_sizes.sum()) == 12
    assert [int(ed.plan(counts, i, mode="ragged", rows=12).overflow) for i in range(4)] == [
        6, 0, 0, 6]
    # room for everything: nothing is cut
    assert [int(ed.plan(counts, i, mode="ragged", rows=24).send_sizes[0])
            for i in range(4)] == [10, 1, 3, 10]


def test_default_mode_follows_the_mesh_devices():
    """The default exchange is chosen by the platform of the mesh's devices (the mesh in context,
    else JAX's default backend): capacity on the host, ragged on accelerators."""
    import types

    cpu = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    assert ed.default_mode(cpu) == "capacity"
    with jax.set_mesh(cpu):
        assert ed.default_mode() == "capacity"
    assert ed.default_mode(cpu.abstract_mesh) == "capacity"
    gpu = types.SimpleNamespace(abstract_device=types.SimpleNamespace(platform="gpu"))
    assert ed.default_mode(gpu) == "ragged"
