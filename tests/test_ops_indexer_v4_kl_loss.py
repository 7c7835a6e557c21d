"""Tests for jax_dsa.ops.indexer.v4_kl_loss against a float64 NumPy oracle written from the formula
(teacher with the window and sink mass in the denominator, Megatron-LM dev ``csa.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_dsa.ops.indexer import indexer_kl_loss, indexer_topk
from jax_dsa.ops.indexer import v4_indexer_kl_loss

B, SQ, SKV, H, HI, D, DI, K = 2, 12, 6, 3, 4, 8, 6, 4
SCALE = D**-0.5


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    iq = rng.standard_normal((B, SQ, HI, DI))
    ik = rng.standard_normal((B, SKV, DI))
    iw = rng.standard_normal((B, SQ, HI))
    q = rng.standard_normal((B, SQ, H, D))
    kv = rng.standard_normal((B, SKV, D))
    # Two packed documents per row (queries 0..6 and 7..11), three and two entries, one unused.
    q_pos = np.concatenate([np.arange(7), np.arange(5)])[None].repeat(B, 0).astype(np.int32)
    q_seg = np.concatenate([np.zeros(7), np.ones(5)])[None].repeat(B, 0).astype(np.int32)
    kv_pos = np.array([1, 3, 5, 0, 2, 2**31 - 1])[None].repeat(B, 0).astype(np.int32)
    kv_seg = np.array([0, 0, 0, 1, 1, -1])[None].repeat(B, 0).astype(np.int32)
    idx = rng.integers(-1, SKV + 1, size=(B, SQ, K)).astype(np.int32)  # -1 and S_kv: invalid
    extra = rng.standard_normal((B, SQ, H)) * 2  # log of window + sink mass, per head
    return dict(iq=iq, ik=ik, iw=iw, q=q, kv=kv, q_pos=q_pos, q_seg=q_seg, kv_pos=kv_pos,
                kv_seg=kv_seg, idx=idx, extra=extra)


def _support(x, b, t, sparse):
    def vis(s):
        return x["kv_pos"][b, s] <= x["q_pos"][b, t] and x["kv_seg"][b, s] == x["q_seg"][b, t]

    if not sparse:
        return [s for s in range(SKV) if vis(s)]
    return [int(s) for s in x["idx"][b, t] if 0 <= s < SKV and vis(int(s))]


def _full_lse(x, sparse):
    """log(window/sink mass + exp of every logit the attention used) per (b, t, h)."""
    out = np.empty((B, SQ, H))
    for b in range(B):
        for t in range(SQ):
            sup = _support(x, b, t, sparse)
            logits = SCALE * x["q"][b, t] @ x["kv"][b, sup].T  # [H, |S|]
            with np.errstate(divide="ignore"):  # a row with no mass at all: -inf
                out[b, t] = np.log(np.exp(x["extra"][b, t]) + np.exp(logits).sum(-1))
    return out


def _oracle(x, lse, sparse):
    total, rows = 0.0, 0
    for b in range(B):
        for t in range(SQ):
            sup = _support(x, b, t, sparse)
            if not sup:
                continue
            logits = SCALE * x["q"][b, t] @ x["kv"][b, sup].T  # [H, n]
            target = np.exp(logits - lse[b, t][:, None]).sum(0)
            target /= target.sum()
            dots = x["iq"][b, t] @ x["ik"][b, sup].T  # [HI, n]
            score = (np.maximum(dots, 0) * x["iw"][b, t][:, None]).sum(0)
            log_pi = score - score.max() - np.log(np.exp(score - score.max()).sum())
            total += np.sum(target * (np.log(target) - log_pi))
            rows += 1
    return total / rows


def _loss(x, lse, sparse, **kw):
    return v4_indexer_kl_loss(
        x["iq"], x["ik"], x["iw"], x["q"], x["kv"], lse, sm_scale=SCALE, q_positions=x["q_pos"],
        kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"], kv_segment_ids=x["kv_seg"],
        indices=x["idx"] if sparse else None, **kw,
    )


@pytest.mark.parametrize("sparse", [False, True])
def test_matches_float64_oracle(sparse):
    x = _inputs()
    lse = _full_lse(x, sparse)
    with jax.enable_x64(True):
        got = float(_loss(x, lse, sparse, block_q=5))
    np.testing.assert_allclose(got, _oracle(x, lse, sparse), rtol=1e-10)
    got32 = float(_loss({k: (v.astype(np.float32) if v.dtype == np.float64 else v)
                         for k, v in x.items()}, lse.astype(np.float32), sparse))
    np.testing.assert_allclose(got32, _oracle(x, lse, sparse), rtol=1e-4)


@pytest.mark.parametrize("sparse", [False, True])
def test_without_window_mass_equals_v32_loss(sparse):
    """attention_lse = the per-head log-sum-exp over the support alone -> the V3.2 head mean."""
    x = _inputs(1)
    x["extra"] = np.full_like(x["extra"], -np.inf)
    lse = _full_lse(x, sparse)
    lse = np.where(np.isfinite(lse), lse, 0.0)  # rows without support: any value
    with jax.enable_x64(True):
        got = float(_loss(x, lse, sparse))
        v32 = float(indexer_kl_loss(
            x["iq"], x["ik"], x["iw"], x["q"], x["kv"], sm_scale=SCALE, q_positions=x["q_pos"],
            kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"], kv_segment_ids=x["kv_seg"],
            indices=x["idx"] if sparse else None,
        ))
    np.testing.assert_allclose(got, v32, rtol=1e-10)
    # With per-head window/sink mass the teacher reweights the heads: a different loss.
    x2 = _inputs(1)
    with jax.enable_x64(True):
        assert abs(float(_loss(x2, _full_lse(x2, sparse), sparse)) - v32) > 1e-4


def test_common_shift_of_the_denominator_cancels_without_underflow():
    """exp(logit - lse) underflows float32 at a shift of 200; the log-space target does not."""
    x = {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in _inputs(2).items()}
    lse = _full_lse(x, False).astype(np.float32)
    base = float(_loss(x, lse, False))
    shifted = float(_loss(x, lse + np.float32(200.0), False))
    assert np.isfinite(shifted)
    np.testing.assert_allclose(shifted, base, rtol=1e-5)


def test_gradients():
    x = _inputs(3)
    lse = _full_lse(x, True)
    with jax.enable_x64(True):
        def f(iq, ik, iw):
            return v4_indexer_kl_loss(
                iq, ik, iw, x["q"], x["kv"], lse, sm_scale=SCALE, q_positions=x["q_pos"],
                kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"], kv_segment_ids=x["kv_seg"],
                indices=x["idx"],
            )

        check_grads(f, (jnp.asarray(x["iq"]), jnp.asarray(x["ik"]), jnp.asarray(x["iw"])),
                    order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
        g = jax.grad(
            lambda q, kv, lse_: _loss(dict(x, q=q, kv=kv), lse_, True), argnums=(0, 1, 2)
        )(jnp.asarray(x["q"]), jnp.asarray(x["kv"]), jnp.asarray(lse))
    for gi in g:  # the teacher is detached
        assert not np.asarray(gi).any()


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16))


# As tests/test_ops_indexer_kl_loss.py: float32 accumulation rounded once gives 1.00x the floor; index_k's
# gradient accumulated in bf16 gave 5.9x (sparse) and 1.5x (dense).
BF16_GRAD_FACTOR = 1.25


@pytest.mark.parametrize("sparse", [True, False])
def test_bfloat16_gradients_accumulate_in_float32(sparse):
    """bf16 index tensors at V4-like dims scaled down (index heads 16 x 128, H 16, D 512,
    top-k 128, S 512): each gradient against the float64 one of the same bf16-rounded inputs
    is within BF16_GRAD_FACTOR of the floor (the float64 gradient rounded to bf16 once)."""
    rng = np.random.default_rng(30)
    s, h_i, d_i, h, d, topk = 512, 16, 128, 16, 512, 128
    iq = _bf16(rng.standard_normal((s, h_i, d_i)))
    ik = _bf16(rng.standard_normal((s, d_i)))
    iw = _bf16(rng.standard_normal((s, h_i)) * (h_i * d_i) ** -0.5)
    q = _bf16(rng.standard_normal((s, h, d)))
    kv = _bf16(rng.standard_normal((s, d)))
    pos = np.arange(s, dtype=np.int32)
    scale = d**-0.5
    if sparse:
        idx = np.asarray(indexer_topk(iq, ik, iw, topk=topk, q_positions=pos, kv_positions=pos))
        support = np.zeros((s, s), bool)
        rows = np.repeat(np.arange(s), topk)
        ok = idx.reshape(-1) >= 0
        support[rows[ok], idx.reshape(-1)[ok]] = True
    else:
        idx = None
        support = pos[None, :] <= pos[:, None]
    # attention_lse: the support's log-sum-exp per head plus window and sink mass.
    logits = scale * (q.astype(np.float64).reshape(s * h, d) @ kv.astype(np.float64).T)
    logits = np.where(support[:, None, :], logits.reshape(s, h, s), -np.inf)
    m = logits.max(-1)
    lse = m + np.log(np.exp(logits - m[..., None]).sum(-1))
    lse = np.logaddexp(lse, rng.standard_normal((s, h)) + 1.0).astype(np.float32)

    def loss(iq, ik, iw, q, kv, lse):
        return v4_indexer_kl_loss(iq, ik, iw, q, kv, lse, sm_scale=scale, q_positions=pos,
                                  kv_positions=pos, indices=idx)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    bf = jnp.bfloat16
    got = grad(*(jnp.asarray(x, bf) for x in (iq, ik, iw, q, kv)), jnp.asarray(lse))
    assert all(g.dtype == bf for g in got)
    with jax.enable_x64(True):
        want = grad(*(jnp.asarray(x, jnp.float64) for x in (iq, ik, iw, q, kv, lse)))
        want = [np.asarray(g) for g in want]
    for name, g, w in zip(("index_q", "index_k", "index_weights"), got, want):
        floor = _rel_l2(_bf16(w), w)
        assert 5e-4 < floor < 4e-3, (name, floor)  # bf16's rounding error, not a tiny gradient
        err = _rel_l2(g, w)
        assert err <= BF16_GRAD_FACTOR * floor, (name, err, floor)


def test_errors():
    x = _inputs()
    lse = _full_lse(x, False)
    with pytest.raises(ValueError, match="attention_lse"):
        _loss(x, lse[..., :2], False)
    with pytest.raises(TypeError, match="sm_scale"):
        v4_indexer_kl_loss(x["iq"], x["ik"], x["iw"], x["q"], x["kv"], lse, sm_scale=None,
                           q_positions=x["q_pos"], kv_positions=x["kv_pos"])
    with pytest.raises(ValueError, match="kv"):
        v4_indexer_kl_loss(x["iq"], x["ik"], x["iw"], x["q"], x["kv"][..., :3], lse,
                           sm_scale=SCALE, q_positions=x["q_pos"], kv_positions=x["kv_pos"])


@pytest.mark.parametrize("sparse", [False, True])
def test_a_row_with_infinite_lse_adds_zero_not_nan(sparse):
    """``attention_lse = +inf`` (what sparse_mla gives a row without a valid slot) makes that
    row's target all zeros: its KL terms are 0, the loss and gradients stay finite."""
    x = _inputs()
    lse = _full_lse(x, sparse)
    lse[0, 3] = np.inf
    loss, grads = jax.value_and_grad(
        lambda iq, ik, iw: _loss(dict(x, iq=iq, ik=ik, iw=iw), lse, sparse), argnums=(0, 1, 2)
    )(*(jnp.asarray(x[k], jnp.float32) for k in ("iq", "ik", "iw")))
    assert np.isfinite(float(loss))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
