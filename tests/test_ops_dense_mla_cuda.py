"""dense_mla(implementation="cuda"): the SM90 forward kernel's contiguous mode
(jax_dsa/ops/dense_mla/cuda.py).

On any machine: the run glue (every query's visible keys become one run of sorted kv rows)
against visible_mask, the supported() rules, the backward's key chunks with the kernel's
pure-JAX contract (tests/cuda_doubles.py) against the "xla" backward, and the CUDA lowering of a
training step (our dense forward and the chunked backward calls, no [S, S] array). The ``gpu``
tests (an SM90 GPU, ``make test-gpu``): out, lse and the gradients against the float64 "xla"
implementation at GLM-5's and V4's widths.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuda_doubles
from jax_dsa import _native, dense_mla
from jax_dsa.ops.dense_mla import cuda as dense_cuda
from jax_dsa.ops.dense_mla.config import Call
from jax_dsa.ops.indexer import visible_mask


def _layouts(rng, b, s):
    """Packed documents in runs, segments interleaved (not runs), arbitrary positions."""
    seg = np.sort(rng.integers(0, 4, (b, s)), axis=1)
    pos = np.zeros((b, s), np.int64)
    for r in range(b):
        for i in range(1, s):
            pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    yield seg, pos, pos
    yield rng.integers(0, 3, (b, s)), rng.integers(0, 10, (b, s)), None
    yield None, pos, rng.integers(-2, s, (b, s))


def test_runs_hold_exactly_the_visible_keys():
    rng = np.random.default_rng(0)
    b, s = 2, 45
    for seg, kv_pos, q_pos in _layouts(rng, b, s):
        q_pos = kv_pos if q_pos is None else q_pos
        segs = (None, None) if seg is None else (jnp.asarray(seg), jnp.asarray(seg))
        perm, lo, count = map(np.asarray, dense_cuda.dense_runs(
            jnp.asarray(q_pos), jnp.asarray(kv_pos), *segs))
        vis = np.asarray(visible_mask(jnp.asarray(q_pos), jnp.asarray(kv_pos), *segs))
        for r in range(b):
            for t in range(s):
                got = sorted(perm[r, lo[r, t]:lo[r, t] + count[r, t]].tolist())
                assert got == np.nonzero(vis[r, t])[0].tolist(), (r, t)


def _call(**over):
    a = dict(dtype=np.dtype(jnp.bfloat16), h=64, d_qk=576, d_v=512, s_q=64, s_kv=64,
             segmented=False)
    a.update(over)
    return Call(**a)


@pytest.mark.parametrize("over,match", [
    (dict(dtype=np.dtype(np.float32)), "bfloat16"),
    (dict(d_qk=256), "D_qk"),
    (dict(d_v=256), "d_v=512"),
    (dict(h=256), "at most 128 heads"),
])
def test_supported_gives_the_rule(over, match):
    why = dense_cuda.supported(_call(**over))
    assert why is not None and re.search(match, why), why


@pytest.mark.parametrize("sink", [False, True])
def test_backward_chunks_match_xla(monkeypatch, sink):
    """The chunked backward (BWD_CHUNK cut to 24: rows over 1-3 chunks and a partial one), with
    the kernel's contract, against the "xla" backward: packed documents in runs and interleaved,
    rows that see no key, padded heads."""
    monkeypatch.setattr(dense_cuda, "cuda_backward_rows", cuda_doubles.backward_rows)
    monkeypatch.setattr(dense_cuda, "BWD_CHUNK", 24)
    rng = np.random.default_rng(4)
    b, s, h, d, d_v = 2, 60, 5, 64, 32
    bf = lambda x: jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)
    q = bf(rng.standard_normal((b, s, h, d)))
    kv = bf(rng.standard_normal((b, s, d)))
    dout = bf(rng.standard_normal((b, s, h, d_v)))
    att = jnp.asarray(rng.standard_normal(h) if sink else np.full(h, -np.inf), jnp.float32)
    for seg, kv_pos, q_pos in _layouts(rng, b, s):
        q_pos = kv_pos if q_pos is None else q_pos
        segs = (None, None) if seg is None else (jnp.asarray(seg), jnp.asarray(seg))
        kw = dict(sm_scale=d ** -0.5, d_v=d_v, q_positions=jnp.asarray(q_pos),
                  kv_positions=jnp.asarray(kv_pos), q_segment_ids=segs[0],
                  kv_segment_ids=segs[1])
        out, lse = dense_mla(q, kv, attn_sink=att, implementation="xla", **kw)
        _, vjp = jax.vjp(lambda q, kv, a: dense_mla(q, kv, attn_sink=a, implementation="xla",
                                                    **kw)[0], q, kv, att)
        want = vjp(dout)
        got = dense_cuda.cuda_dense_backward(
            q, kv, kw["q_positions"], kw["kv_positions"], *segs, att, out, lse, dout,
            sm_scale=kw["sm_scale"])
        for name, a, w in zip(("dq", "dkv", "d_sink"), got, want):
            a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
            assert np.linalg.norm(a - w) <= 5e-3 * np.linalg.norm(w), name  # out in bf16


@pytest.mark.skipif("cuda" not in _native.available(), reason="CUDA module not built")
def test_training_step_lowers_to_the_dense_forward_without_a_slot_list():
    b, s, h, d = 1, 300, 64, 576
    sds = jax.ShapeDtypeStruct
    q, kv = sds((b, s, h, d), jnp.bfloat16), sds((b, s, d), jnp.bfloat16)
    pos = sds((b, s), jnp.int32)

    def loss(q, kv, pos):
        out, _ = dense_mla(q, kv, sm_scale=0.07, q_positions=pos, kv_positions=pos,
                           q_segment_ids=pos // 100, kv_segment_ids=pos // 100,
                           implementation="cuda")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    text = (jax.jit(jax.grad(loss, (0, 1))).trace(q, kv, pos)
            .lower(lowering_platforms=("cuda",)).as_text())
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    ours = [c for c in calls if c[0] == dense_cuda.DENSE_FWD_TARGET]
    assert len(ours) == 1, sorted({c[0] for c in calls})
    assert f"tensor<{b * s}x4xi32>" in ours[0][3]  # each query's run start (column 0)
    bwd = [c for c in calls if c[0] == "jax_dsa_dsa_bwd_cuda"]
    assert len(bwd) == 1 and "stablehlo.while" in text  # the backward over key chunks
    assert not re.search(rf"tensor<(\d+x)?{s}x{s}xi32>", text)  # no [S, S] slot list


def _gpu_inputs(rng, b, s, h, d, docs):
    """bf16 q, kv; packed documents in runs with per-document positions; the first five
    queries see no key."""
    q = jnp.asarray(rng.standard_normal((b, s, h, d)) * 0.5, jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.bfloat16)
    seg = np.sort(rng.integers(0, docs, (b, s)), axis=1).astype(np.int32)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        for i in range(1, s):
            pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    q_pos = pos.copy()
    q_pos[:, :5] = -1
    return q, kv, seg, pos, q_pos


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,d,docs,sink", [
    (1, 1000, 64, 576, 4, False),  # GLM-5 dims, packed documents, S not a multiple of 64
    (2, 333, 16, 512, 2, True),    # padded heads, V4 width, a sink
])
def test_gpu_matches_float64(b, s, h, d, docs, sink):
    rng = np.random.default_rng(s)
    q, kv, seg, pos, q_pos = _gpu_inputs(rng, b, s, h, d, docs)
    att = jnp.asarray(rng.standard_normal(h), jnp.float32) if sink else None
    kw = dict(sm_scale=d ** -0.5, q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(pos),
              q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
    out, lse = jax.jit(lambda q, kv, a: dense_mla(q, kv, attn_sink=a, implementation="cuda",
                                                  **kw))(q, kv, att)
    with jax.enable_x64(True):
        ref_out, ref_lse = dense_mla(q.astype(jnp.float64), kv.astype(jnp.float64),
                                     attn_sink=None if att is None else att.astype(jnp.float64),
                                     implementation="xla", **kw)
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    empty = ~np.isfinite(ref_lse)
    assert np.all(np.isinf(lse[empty])) and np.all(out[empty] == 0)
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(np.where(empty, 0, lse - ref_lse))) < 1e-2
    assert np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,d,docs,sink,chunk", [
    (1, 2500, 64, 576, 3, False, 1024),  # GLM-5 dims, three key chunks (the last partial)
    (2, 333, 16, 512, 2, True, None),    # padded heads, V4 width, a sink, one chunk
])
def test_gpu_gradients_match_float64(monkeypatch, b, s, h, d, docs, sink, chunk):
    if chunk:
        monkeypatch.setattr(dense_cuda, "BWD_CHUNK", chunk)
    rng = np.random.default_rng(s + 1)
    q, kv, seg, pos, q_pos = _gpu_inputs(rng, b, s, h, d, docs)
    att = jnp.asarray(rng.standard_normal(h) if sink else np.full(h, -np.inf), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, s, h, 512)), jnp.float32)
    kw = dict(sm_scale=d ** -0.5, q_positions=jnp.asarray(q_pos), kv_positions=jnp.asarray(pos),
              q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))

    def loss(q, kv, a, impl):
        out, _ = dense_mla(q, kv, attn_sink=a, implementation=impl, **kw)
        return jnp.sum(out.astype(w.dtype) * w)

    got = jax.jit(jax.grad(lambda *x: loss(*x, "cuda"), (0, 1, 2)))(q, kv, att)
    with jax.enable_x64(True):
        w = w.astype(jnp.float64)
        want = jax.jit(jax.grad(lambda *x: loss(*x, "xla"), (0, 1, 2)))(
            q.astype(jnp.float64), kv.astype(jnp.float64), att.astype(jnp.float64))
    for name, a, r in zip(("dq", "dkv", "d_sink"), got, want):
        a, r = np.asarray(a, np.float64), np.asarray(r)
        assert np.all(np.isfinite(a)), name
        assert np.linalg.norm(a - r) <= 1e-2 * np.linalg.norm(r), name
