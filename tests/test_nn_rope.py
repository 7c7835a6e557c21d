"""Tests for jax_dsa.nn.rope against NumPy float64 formulas.

The helpers here (``np_inv_freq``, ``np_rope``) are the independent oracle also used by
tests/test_models_glm_attention.py and tests/test_models_glm_indexer.py.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa.configs import RopeParameters
from jax_dsa.nn.rope import apply_rope, inv_frequencies, rope_cos_sin


def np_inv_freq(p: RopeParameters, dim: int) -> np.ndarray:
    """RoPE / YaRN inverse frequencies, written per dimension pair from the YaRN recipe of
    DeepSeek-V3 (correction range in dim space from beta_fast/beta_slow rotations over the
    original context, linear ramp between original and factor-interpolated frequencies)."""
    out = []
    for i in range(dim // 2):
        theta = p.rope_theta ** (-2.0 * i / dim)
        if p.rope_type == "yarn":
            L = p.original_max_position_embeddings

            def dim_for(rot):  # the dim whose wavelength fits `rot` times into L
                return dim * math.log(L / (rot * 2 * math.pi)) / (2 * math.log(p.rope_theta))

            lo = max(math.floor(dim_for(p.beta_fast)), 0)
            hi = min(math.ceil(dim_for(p.beta_slow)), dim - 1)
            if hi == lo:
                hi += 0.001
            t = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep, 1: interpolate
            theta = theta * (1 - t) + theta / p.factor * t
        out.append(theta)
    return np.array(out)


def np_rope(x, pos, inv_freq, interleave, scale=1.0):
    """Rotate ``x [..., S, (H,) d]`` at integer positions ``pos [..., S]`` via complex numbers."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    if interleave:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq
    rot = np.exp(1j * ang) * scale
    if z.ndim == rot.ndim + 1:  # heads axis
        rot = rot[..., None, :]
    z = z * rot
    out = np.empty_like(x)
    if interleave:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2 :] = z.real, z.imag
    return out


PLAIN = RopeParameters(rope_type="default", rope_theta=10000.0)
YARN = RopeParameters(
    rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
)
YARN_TINY = RopeParameters(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
    mscale=1.0, mscale_all_dim=1.0,
)


@pytest.mark.parametrize("p, dim", [(PLAIN, 64), (YARN, 64), (YARN_TINY, 16), (PLAIN, 2)])
def test_inv_frequencies(p, dim):
    np.testing.assert_allclose(inv_frequencies(p, dim), np_inv_freq(p, dim), rtol=1e-13)


def test_yarn_bands():
    """High-frequency pairs keep their frequency, low-frequency ones are divided by factor."""
    inv = inv_frequencies(YARN, 64)
    plain = inv_frequencies(PLAIN, 64)
    # DeepSeek V3.2: correction range dims [floor(10.2), ceil(22.9)] = [10, 23].
    np.testing.assert_allclose(inv[:11], plain[:11], rtol=1e-15)
    np.testing.assert_allclose(inv[23:], plain[23:] / 40, rtol=1e-15)
    assert np.all(inv[11:23] < plain[11:23]) and np.all(inv[11:23] > plain[11:23] / 40)
    with pytest.raises(ValueError, match="even"):
        inv_frequencies(PLAIN, 7)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("p", [PLAIN, YARN_TINY])
def test_apply_rope_matches_numpy(interleave, p):
    rng = np.random.default_rng(0)
    b, s, h, d = 2, 9, 3, 16
    x = rng.standard_normal((b, s, h, d)).astype(np.float32)
    pos = rng.integers(0, 500, (b, s)).astype(np.int32)
    cos, sin = rope_cos_sin(jnp.asarray(pos), p, d)
    got = apply_rope(jnp.asarray(x), cos[:, :, None], sin[:, :, None], interleave=interleave)
    want = np_rope(x, pos, np_inv_freq(p, d), interleave)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-4)
    # Without a heads axis (the shared key).
    got_k = apply_rope(jnp.asarray(x[:, :, 0]), cos, sin, interleave=interleave)
    np.testing.assert_allclose(np.asarray(got_k), want[:, :, 0], rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("interleave", [True, False])
def test_relative_position(interleave):
    """<R(m) q, R(n) k> depends only on m - n."""
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, 32)).astype(np.float32)
    def dot(m, n):
        pos = jnp.array([[m], [n]], jnp.int32)
        cos, sin = rope_cos_sin(pos, PLAIN, 32)
        r = apply_rope(jnp.asarray(np.concatenate([q, k])), cos, sin, interleave=interleave)
        return float(jnp.sum(r[0] * r[1]))
    assert dot(5, 2) == pytest.approx(dot(105, 102), rel=1e-4, abs=1e-4)
    assert dot(5, 2) != pytest.approx(dot(5, 3), rel=1e-3)


def test_interleave_matches_transformers_layout_up_to_permutation():
    """transformers' apply_rotary_pos_emb_interleave de-interleaves to [even | odd] dims and then
    rotates half-split; our interleaved output permuted that way must equal it."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 6, 8)).astype(np.float32)
    pos = np.arange(6)[None]
    inv = np_inv_freq(PLAIN, 8)
    # transformers' recipe, in NumPy: cos/sin = cat(freqs, freqs); x -> [x0 x2 x4 x6 x1 x3 x5 x7].
    ang = pos[..., None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    xp = x[..., perm]
    rot_half = np.concatenate([-xp[..., 4:], xp[..., :4]], -1)
    hf = xp * cos + rot_half * sin
    c, s = rope_cos_sin(jnp.asarray(pos), PLAIN, 8)
    ours = np.asarray(apply_rope(jnp.asarray(x), c, s, interleave=True))
    np.testing.assert_allclose(ours[..., perm], hf, rtol=1e-5, atol=1e-5)


def test_cos_sin_scale_applied():
    p = RopeParameters(rope_type="yarn", factor=8.0, original_max_position_embeddings=32)
    cos, sin = rope_cos_sin(jnp.zeros((1, 1), jnp.int32), p, 4)
    np.testing.assert_allclose(np.asarray(cos), p.cos_sin_scale, rtol=1e-6)
    assert p.cos_sin_scale == pytest.approx(0.1 * math.log(8) + 1)


def test_apply_rope_shape_error():
    cos = jnp.ones((1, 3))
    with pytest.raises(ValueError, match="twice"):
        apply_rope(jnp.ones((1, 8)), cos, cos, interleave=True)
