"""Tests for jax_dsa.models.deepseek_v4.slots: the bucket ladder, slot widths per layer type over
sequence lengths 1K..32K (the count of distinct widths = kernel programs), and the slot-list
assembly against a brute-force construction."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.config import CSA, HCA, LAYER_TYPES, SLIDING
from jax_dsa.models.deepseek_v4.slots import (
    SLOT_BUCKETS,
    assemble,
    slot_bucket,
    slot_width,
    window,
)


def test_ladder():
    assert all(b % 128 == 0 for b in SLOT_BUCKETS)
    assert list(SLOT_BUCKETS) == sorted(set(SLOT_BUCKETS))
    assert SLOT_BUCKETS[:9] == tuple(range(128, 1153, 128))
    for n in range(1, 40000, 7):
        b = slot_bucket(n)
        assert b >= n and b in SLOT_BUCKETS
        assert all(x < n for x in SLOT_BUCKETS if x < b)  # the smallest that fits
        assert b <= max(128, 1.5 * n) + 128  # bounded padding
    with pytest.raises(ValueError, match="n must be"):
        slot_bucket(0)


@pytest.mark.parametrize("name, csa_width", [("deepseek-v4-flash", 640),
                                             ("deepseek-v4-pro", 1152)])
def test_distinct_widths_over_1k_to_32k(name, csa_width):
    c = get_config(name)
    lengths = range(1024, 32768 + 1, 128)
    widths = {t: {slot_width(c, t, s) for s in lengths} for t in LAYER_TYPES}
    assert widths[SLIDING] == {128}
    assert widths[CSA] == {csa_width}
    assert widths[HCA] == {256, 384}
    # Without the ladder HCA alone would need one width per 128 tokens of sequence.
    raw = {c.sliding_window + s // c.compress_rate_hca for s in lengths}
    assert len(raw) == len(lengths)
    assert sum(len(w) for w in widths.values()) == 4
    # The dense warm-up of CSA layers attends to every visible entry: S // 4 more slots.
    dense = {slot_width(c, CSA, s, "dense") for s in lengths}
    assert max(dense) == slot_bucket(128 + 32768 // 4)


def test_window_and_assemble_against_brute_force():
    rng = np.random.default_rng(0)
    lengths = [7, 20, 3]
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)[None]
    s, w, k, width = pos.shape[1], 5, 4, 16
    first, n_w = window(jnp.asarray(pos), w)
    # Compressed lists: valid prefix then -1 (what the indexer's top-k gives).
    counts = rng.integers(0, k + 1, size=(1, s))
    comp = np.full((1, s, k), -1, np.int32)
    for t in range(s):
        comp[0, t, : counts[0, t]] = rng.choice(10, size=counts[0, t], replace=False)
    idx, length = assemble(first, n_w, width, compressed=jnp.asarray(comp), compressed_offset=s)
    c0 = rng.integers(0, 5, size=(1, s))
    idx2, length2 = assemble(first, n_w, width, compressed_first=jnp.asarray(c0),
                             compressed_count=jnp.asarray(counts), compressed_offset=s)
    starts = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    for t in range(s):
        win = list(range(max(starts[t], t - w + 1), t + 1))
        want = win + [s + int(v) for v in comp[0, t, : counts[0, t]]]
        assert np.asarray(idx[0, t]).tolist() == want + [-1] * (width - len(want))
        assert int(length[0, t]) == len(want)
        want2 = win + [s + int(c0[0, t]) + i for i in range(counts[0, t])]
        assert np.asarray(idx2[0, t]).tolist() == want2 + [-1] * (width - len(want2))
        assert int(length2[0, t]) == len(want2)
