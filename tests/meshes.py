"""Mesh helpers shared by the sharding tests (tests/test_sharding_*.py) and the ops' sharding
tests (tests/test_ops_*.py): the layouts on the 8 CPU devices of tests/conftest.py, meshes, specs, the
comparison with an unsharded run and the collectives of compiled HLO."""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

# name -> mesh axis sizes; a one-axis layout uses as many of the 8 devices as the dims allow.
LAYOUTS = {
    "dp": {"dp": 2},
    "tp": {"tp": 4},
    "cp": {"cp": 4},
    "dp+cp+tp": {"dp": 2, "cp": 2, "tp": 2},
}


def make_mesh(sizes, axis_type=AxisType.Auto):
    n = int(np.prod(list(sizes.values())))
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(axis_type,) * len(sizes),
                         devices=jax.devices()[:n])


def spec(mesh, *dims):
    """PartitionSpec naming only the mesh's axes among ``dims``."""
    return P(*(d if d in mesh.axis_names else None for d in dims))


def assert_close(got, want, rel=1e-5, what=""):
    """max |got - want| <= rel * max |want| (finite entries), and the same non-finite entries."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=what)
    np.testing.assert_array_equal(got[~fin], want[~fin], err_msg=what)
    scale = max(np.abs(want[fin]).max(initial=0.0), 1e-30)
    err = np.abs(got[fin] - want[fin]).max(initial=0.0)
    assert err <= rel * scale, f"{what}: max error {err:.3g} > {rel} * {scale:.3g}"


def collectives(compiled_text):
    """``[(op, result shapes)]`` of the collectives in compiled HLO text."""
    out = []
    for line in compiled_text.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all|"
                      r"collective-permute)(?:-start)?\(", line)
        if m:
            shapes = [tuple(int(d) for d in dims.split(",") if d)
                      for dims in re.findall(r"\w+\[([\d,]*)\]", m.group(1))]
            out.append((m.group(2), shapes))
    return out
