"""indexer_kl_loss(implementation="cuda"): the SM90 KL loss (jax_dsa/ops/indexer/kl_loss/
cuda.py, the _cuda_indexer module's kernels).

On any machine: the supported() rules; the XLA glue around the kernels, with their pure-JAX
contracts (tests/cuda_doubles.py) monkeypatched in, against the "xla" implementation and the
float64 oracle (values, gradients, head and sequence sharding); the CUDA lowering of jax.grad
(our custom calls with the kernels' operand shapes, no gather of [S, K, .] rows in XLA). The
``gpu`` tests (an SM90 GPU, ``make test-gpu``): the kernels against their contracts, and the loss
and gradients against the float64 oracle (tests/oracle.py) on bf16-rounded inputs, at GLM-5's
dims (H 64, D_qk 576, 32 x 128 index heads, K 2048) and others. benchmarks/ops/indexer_kl_loss.py
times it.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import cuda_doubles
import oracle
from jax_dsa.ops.indexer.kl_loss import op as kl_loss
from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.indexer.kl_loss.config import KLCall
from jax_dsa.ops.registry import Unavailable
from oracle import attention_lse, rel_l2, slot_scores

BF16 = ml_dtypes.bfloat16


def bf16_round(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


@pytest.fixture
def cuda_op(monkeypatch):
    """indexer_kl_loss with "cuda" selectable whatever this install built (lowering and glue
    tests need no GPU and no kernels)."""
    monkeypatch.setattr(kl_loss_cuda, "module_error", lambda: None)
    return kl_loss.indexer_kl_loss


@pytest.fixture
def reference_kernels(cuda_op, monkeypatch):
    """The kernels' pure-JAX contracts in place of the FFI calls (runs anywhere)."""
    for name, double in cuda_doubles.KL_KERNELS.items():
        monkeypatch.setattr(kl_loss_cuda, name, double)
    return cuda_op


# ---------------------------------------------------------------------------------------------
# supported()


def _call(**over):
    a = dict(dtype=np.dtype(np.float32), index_n_heads=32, index_head_dim=128, h=64, d_qk=576,
             s_q=512, s_kv=512, topk=256, segments=False)
    a.update(over)
    return KLCall(**a)


@pytest.mark.parametrize("over,match", [
    (dict(d_qk=128), "D_qk"),
    (dict(index_head_dim=64), "index_head_dim 128"),
    (dict(index_n_heads=128), "at most 64 index heads"),
    (dict(h=256), "at most 128 heads"),
    (dict(topk=4096), "at most 2048 slots"),
    (dict(dtype=np.dtype(np.float64)), "float64"),
])
def test_supported_gives_the_rule(over, match):
    why = kl_loss_cuda.supported(_call(**over))
    assert why is not None and re.search(match, why), why
    assert not isinstance(why, Unavailable)  # a property of the call, told even without kernels


def test_supported_reports_the_module_or_takes_the_call(monkeypatch):
    why = kl_loss_cuda.supported(_call())
    if kl_loss_cuda.module_error() is None:
        assert why is None or "SM90" in why
    else:
        assert isinstance(why, Unavailable) and "_cuda_indexer" in why
    monkeypatch.setattr(kl_loss_cuda, "module_error", lambda: None)
    for over in ({}, dict(h=128, d_qk=512, index_n_heads=64, topk=2048), dict(h=1, index_n_heads=1,
                                                                               topk=1)):
        why = kl_loss_cuda.supported(_call(**over))
        assert why is None or "SM90" in why, why


# ---------------------------------------------------------------------------------------------
# Inputs (the float64 oracle: tests/oracle.py)


def add_invalid_slots(rng, idx, s_kv):
    """In place: -1 and out-of-range slots, duplicates, a row without any valid slot."""
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.02] = s_kv + 3  # out of range
    idx[:, ::7, 1] = idx[:, ::7, 0]  # duplicates
    idx[0, 1] = -1  # a row without any valid slot
    if idx.shape[1] > 5:
        idx[-1, 5] = s_kv  # another, out of range


def make_inputs(rng, nb, s_q, s_kv, h, d_qk, h_i, k, segments=True, invalid=True):
    """bf16-representable float32 inputs with -1 and out-of-range slots, duplicates, rows
    without support, packed documents (per-document positions)."""
    iq = bf16_round(rng.standard_normal((nb, s_q, h_i, 128)))
    ik = bf16_round(rng.standard_normal((nb, s_kv, 128)))
    iw = (rng.standard_normal((nb, s_q, h_i)) * h_i ** -0.5 * 128 ** -0.5).astype(np.float32)
    q = bf16_round(rng.standard_normal((nb, s_q, h, d_qk)))
    kv = bf16_round(rng.standard_normal((nb, s_kv, d_qk)))
    off = s_kv - s_q  # queries are the last s_q of s_kv positions
    q_pos = np.tile(np.arange(s_q, dtype=np.int32) + off, (nb, 1))
    kv_pos = np.tile(np.arange(s_kv, dtype=np.int32), (nb, 1))
    q_seg = kv_seg = None
    if segments:
        kv_seg = np.zeros((nb, s_kv), np.int32)
        cut = s_kv // 3
        kv_seg[:, cut:] = 1
        kv_pos[:, cut:] -= cut
        q_seg = kv_seg[:, off:].copy()
        q_pos = kv_pos[:, off:].copy()
    idx = rng.integers(0, s_kv, (nb, s_q, k)).astype(np.int32)
    # Mostly visible slots: draw below each query's global position.
    glob = np.arange(s_q) + off
    idx = (rng.random((nb, s_q, k)) * (glob[None, :, None] + 1)).astype(np.int32)
    if invalid:
        add_invalid_slots(rng, idx, s_kv)
    return dict(iq=iq, ik=ik, iw=iw, q=q, kv=kv, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg,
                kv_seg=kv_seg, idx=idx)


def dense_inputs(rng, nb, s_q, s_kv, h, d_qk, h_i, segments=True, shuffle=False):
    """make_inputs for the dense form: ``idx`` every key (the oracle's slot list, not passed to
    the op: ``dense=True``). ``shuffle``: the keys stored in a random order (positions and
    segment ids permuted with them), so the glue's sort into runs is not the identity."""
    x = make_inputs(rng, nb, s_q, s_kv, h, d_qk, h_i, 1, segments, invalid=False)
    if shuffle:
        order = rng.permutation(s_kv)
        for name in ("ik", "kv", "kv_pos", "kv_seg"):
            if x[name] is not None:
                x[name] = np.ascontiguousarray(x[name][:, order])
    x["idx"] = np.broadcast_to(np.arange(s_kv, dtype=np.int32), (nb, s_q, s_kv)).copy()
    x["dense"] = True
    return x


def loss_and_grads(op, x, sm_scale, impl, jit=True, lse=None, scores=None):
    """value_and_grad in (index_q, index_k, index_weights). Every tensor is an argument: closed
    over, they would be constants that XLA folds through the loss at compile time (~15 s)."""
    def loss(iq, ik, iw, x, idx, lse, scores):
        return op(iq, ik, iw, x["q"], x["kv"], sm_scale=sm_scale, q_positions=x["q_pos"],
                  kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"], kv_segment_ids=x["kv_seg"],
                  indices=idx, attention_lse=lse, index_scores=scores, implementation=impl)

    f = jax.value_and_grad(loss, argnums=(0, 1, 2))
    if jit:
        f = jax.jit(f)
    tensors = {k: v for k, v in x.items() if k not in ("dense", "idx")}
    idx = None if x.get("dense") else x["idx"]  # dense: the oracle's slot list, not the op's
    return f(x["iq"], x["ik"], x["iw"], tensors, idx, lse, scores)


# ---------------------------------------------------------------------------------------------
# The glue, with the kernels' contracts (any machine)


@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k", [
    (2, 24, 40, 80, 512, 5, 37),   # two head groups (80 = 64 + 16), odd K
    (1, 17, 17, 3, 576, 32, 300),  # K > S_kv: many duplicates
])
def test_glue_matches_xla(reference_kernels, nb, s_q, s_kv, h, d_qk, h_i, k):
    x = make_inputs(np.random.default_rng(k), nb, s_q, s_kv, h, d_qk, h_i, k)
    sm_scale = d_qk ** -0.5
    got_l, got_g = loss_and_grads(reference_kernels, x, sm_scale, "cuda")
    want_l, want_g = loss_and_grads(reference_kernels, x, sm_scale, "xla")
    np.testing.assert_allclose(got_l, want_l, rtol=2e-5)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, want_g):
        assert rel_l2(a, b) < 2e-5, name
    ref = oracle.sparse_kl_loss(x, sm_scale)
    np.testing.assert_allclose(got_l, ref[0], rtol=2e-5)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, ref[1:]):
        assert rel_l2(a, b) < 2e-5, name


@pytest.mark.parametrize("impl", ["cuda", "xla"])
def test_given_lse_matches_the_oracle(reference_kernels, impl):
    """attention_lse (the attention's own denominators over the support): the same loss and
    gradients as recomputing the softmax (the float64 oracle), on the cuda glue with the target
    and score kernels' contracts, and on xla."""
    x = make_inputs(np.random.default_rng(11), 2, 24, 40, 80, 512, 5, 37)
    sm_scale = 512 ** -0.5
    lse = attention_lse(x, sm_scale)
    got_l, got_g = loss_and_grads(reference_kernels, x, sm_scale, impl, lse=lse)
    ref = oracle.sparse_kl_loss(x, sm_scale)
    np.testing.assert_allclose(got_l, ref[0], rtol=1e-4)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, ref[1:]):
        assert rel_l2(a, b) < 1e-4, name


@pytest.mark.parametrize("impl", ["cuda", "xla"])
def test_given_scores_match_the_oracle(reference_kernels, monkeypatch, impl):
    """index_scores (the top-k's scores of the slots) with attention_lse: the float64 oracle's
    loss and gradients, and on "cuda" no score kernel in either pass."""
    def no_score_kernel(*a, **k):
        raise AssertionError("the score kernel ran although index_scores were given")

    monkeypatch.setattr(kl_loss_cuda, "score_kernel", no_score_kernel)
    x = make_inputs(np.random.default_rng(12), 2, 24, 40, 80, 512, 5, 37)
    sm_scale = 512 ** -0.5
    got_l, got_g = loss_and_grads(reference_kernels, x, sm_scale, impl,
                                  lse=attention_lse(x, sm_scale), scores=slot_scores(x))
    ref = oracle.sparse_kl_loss(x, sm_scale)
    np.testing.assert_allclose(got_l, ref[0], rtol=1e-4)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, ref[1:]):
        assert rel_l2(a, b) < 1e-4, name


def test_given_scores_are_checked(cuda_op):
    x = make_inputs(np.random.default_rng(0), 1, 8, 8, 4, 512, 2, 6)
    with pytest.raises(ValueError, match=r"index_scores must be \[..., S_q, K\]"):
        loss_and_grads(cuda_op, x, 0.1, "xla", scores=np.zeros((1, 8, 5), np.float32))
    with pytest.raises(TypeError, match="index_scores must be a float array"):
        loss_and_grads(cuda_op, x, 0.1, "xla", scores=np.zeros((1, 8, 6), np.int32))
    x = dense_inputs(np.random.default_rng(0), 1, 8, 8, 4, 512, 2)
    with pytest.raises(ValueError, match="index_scores are the scores of `indices`"):
        loss_and_grads(cuda_op, x, 0.1, "xla", scores=np.zeros((1, 8, 8), np.float32))


def test_given_lse_is_checked(cuda_op):
    x = make_inputs(np.random.default_rng(0), 1, 8, 8, 4, 512, 2, 6)
    with pytest.raises(ValueError, match=r"attention_lse must be \[..., S_q, H\]"):
        loss_and_grads(cuda_op, x, 0.1, "xla", lse=np.zeros((1, 8, 3), np.float32))
    with pytest.raises(TypeError, match="attention_lse must be a float array"):
        loss_and_grads(cuda_op, x, 0.1, "xla", lse=np.zeros((1, 8, 4), np.int32))


@pytest.mark.parametrize("given_lse,shuffle", [
    pytest.param(False, False, marks=pytest.mark.slow), (True, True), (False, True)])
def test_dense_glue_matches_the_oracle(reference_kernels, monkeypatch, given_lse, shuffle):
    """The dense form over several key chunks (CHUNK cut to 16): rows whose keys span 1-3 chunks,
    packed documents, keys stored out of order; with the dense lse recomputed or given."""
    monkeypatch.setattr(kl_loss_cuda, "CHUNK", 16)
    x = dense_inputs(np.random.default_rng(5), 2, 24, 40, 80, 512, 5, shuffle=shuffle)
    sm_scale = 512 ** -0.5
    lse = attention_lse(x, sm_scale) if given_lse else None
    got_l, got_g = loss_and_grads(reference_kernels, x, sm_scale, "cuda", lse=lse)
    ref = oracle.sparse_kl_loss(x, sm_scale)
    tol = 1e-4 if given_lse else 2e-5
    np.testing.assert_allclose(got_l, ref[0], rtol=tol)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, ref[1:]):
        assert rel_l2(a, b) < tol, name
    want_l, want_g = loss_and_grads(reference_kernels, x, sm_scale, "xla", lse=lse)
    np.testing.assert_allclose(got_l, want_l, rtol=tol)
    # Not differentiated: the forward alone (its own passes), the same loss.
    plain = jax.jit(lambda iq, ik, iw, q, kv, lse: reference_kernels(
        iq, ik, iw, q, kv, sm_scale=sm_scale, q_positions=x["q_pos"],
        kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"], kv_segment_ids=x["kv_seg"],
        attention_lse=lse, implementation="cuda"))(x["iq"], x["ik"], x["iw"], x["q"], x["kv"],
                                                   lse)
    np.testing.assert_allclose(plain, ref[0], rtol=tol)


def test_dense_glue_without_visible_keys_is_zero(reference_kernels):
    x = dense_inputs(np.random.default_rng(1), 1, 8, 8, 4, 512, 2, segments=False)
    x["kv_pos"] = x["kv_pos"] + 100  # every key after every query
    loss, grads = loss_and_grads(reference_kernels, x, 0.1, "cuda")
    assert float(loss) == 0.0
    for g in grads:
        assert not np.any(np.asarray(g))


def test_glue_without_any_support_is_zero(reference_kernels):
    x = make_inputs(np.random.default_rng(0), 1, 8, 8, 4, 512, 2, 6)
    x["idx"][:] = -1
    loss, grads = loss_and_grads(reference_kernels, x, 0.1, "cuda")
    assert float(loss) == 0.0
    for g in grads:
        assert not np.any(np.asarray(g))


@pytest.mark.parametrize("sizes,dense", [({"tp": 2}, False), ({"dp": 2, "cp": 2, "tp": 2}, False),
                                         ({"dp": 2, "cp": 2, "tp": 2}, True)])
def test_glue_under_sharding_matches_unsharded(reference_kernels, monkeypatch, sizes, dense):
    """Heads split over tp (the target's head mean psum-ed across shards), rows over cp, batch
    over dp: the same loss and gradients as unsharded (the dense form: gradients from its forward)."""
    n = int(np.prod(list(sizes.values())))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    monkeypatch.setattr(kl_loss_cuda, "CHUNK", 8)
    x = (dense_inputs(np.random.default_rng(3), 2, 16, 16, 8, 512, 4) if dense
         else make_inputs(np.random.default_rng(3), 2, 16, 16, 8, 512, 4, 9))
    want_l, want_g = loss_and_grads(reference_kernels, x, 0.2, "cuda")
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(AxisType.Auto,) * len(sizes), devices=jax.devices()[:n])

    def sp(*dims):
        return jax.sharding.NamedSharding(mesh, P(*(d if d in mesh.axis_names else None
                                                    for d in dims)))

    put = dict(iq=sp("dp", "cp", None, None), ik=sp("dp", "cp", None), iw=sp("dp", "cp", None),
               q=sp("dp", "cp", "tp", None), kv=sp("dp", "cp", None), q_pos=sp("dp", "cp"),
               kv_pos=sp("dp", "cp"), q_seg=sp("dp", "cp"), kv_seg=sp("dp", "cp"),
               idx=sp("dp", "cp", None))
    with jax.set_mesh(mesh):
        xs = {k: v if k == "dense" else jax.device_put(v, put[k]) for k, v in x.items()}
        got_l, got_g = loss_and_grads(reference_kernels, xs, 0.2, "cuda")
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, want_g):
        assert rel_l2(a, b) < 1e-5, name


# ---------------------------------------------------------------------------------------------
# CUDA lowering (no GPU needed)


def _lower_cuda_grad(op, nb, s_q, s_kv, h, d_qk, h_i, k, deterministic=False):
    f32, bf, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sds = jax.ShapeDtypeStruct
    iq, ik, iw = sds((nb, s_q, h_i, 128), bf), sds((nb, s_kv, 128), bf), sds((nb, s_q, h_i), f32)
    q, kv = sds((nb, s_q, h, d_qk), bf), sds((nb, s_kv, d_qk), bf)
    qp, kp, idx = sds((nb, s_q), i32), sds((nb, s_kv), i32), sds((nb, s_q, k), i32)

    def loss(iq, ik, iw, q, kv, qp, kp, idx):
        return op(iq, ik, iw, q, kv, sm_scale=0.07, q_positions=qp, kv_positions=kp,
                  q_segment_ids=qp // 64, kv_segment_ids=kp // 64, indices=idx,
                  implementation="cuda", deterministic=deterministic)

    text = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            .trace(iq, ik, iw, q, kv, qp, kp, idx).lower(lowering_platforms=("cuda",)).as_text())
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    return text, calls


@pytest.mark.parametrize("h,d_qk,h_i,k", [(64, 576, 32, 2048), (100, 512, 64, 300)])
def test_grad_lowers_to_the_two_kernels(cuda_op, h, d_qk, h_i, k):
    nb, s_q, s_kv = 2, 70, 90
    text, calls = _lower_cuda_grad(cuda_op, nb, s_q, s_kv, h, d_qk, h_i, k)
    fwd = [c for c in calls if c[0] == kl_loss_cuda.FWD_TARGET]
    bwd = [c for c in calls if c[0] == kl_loss_cuda.BWD_TARGET]
    # The forward kernel in the forward and again in the backward (identical: XLA merges them).
    assert len(fwd) == 2 and len(bwd) == 1, sorted(set(c[0] for c in calls))
    assert fwd[0][2:] == fwd[1][2:]  # same attributes and operand types
    t, groups = nb * s_q, -(-h // 64)
    _, _, attrs, operands, results = fwd[0]
    for want in (f"tensor<{t}x{h}x{d_qk}xbf16>", f"tensor<{nb * s_kv}x{d_qk}xbf16>",
                 f"tensor<{t}x{h_i}x128xbf16>", f"tensor<{nb * s_kv}x128xbf16>",
                 f"tensor<{t}x{h_i}xf32>", f"tensor<{t}x{k}xi32>", f"tensor<{t}xi32>"):
        assert want in operands, (want, operands)
    assert f"tensor<{groups}x{t}x{k}xf32>" in results and f"tensor<{t}x{k}xf32>" in results
    for name in ("sm_scale", "s_q", "s_kv"):
        assert name in attrs
    _, _, attrs, operands, results = bwd[0]
    assert f"tensor<{t}x{k}xf32>" in operands  # dscore
    for want in (f"tensor<{t}x{h_i}x128xf32>", f"tensor<{nb * s_kv}x128xf32>",
                 f"tensor<{t}x{h_i}xf32>"):
        assert want in results
    # No [S, K, .] rows gathered (or formed) in XLA: no gather at all, no rank-4 [.., K, D].
    assert "gather" not in text
    assert not re.search(rf"tensor<\d+x\d+x{k}x\d+x(bf16|f32)>", text)
    assert not re.search(rf"tensor<\d+x{k}x(128|{d_qk})x(bf16|f32)>", text)


def test_given_lse_lowers_to_the_target_and_score_kernels(cuda_op, monkeypatch):
    monkeypatch.setattr(kl_loss_cuda, "native_unavailable", lambda *a: None)
    f32, bf, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sds = jax.ShapeDtypeStruct
    nb, s_q, s_kv, h, d_qk, h_i, k = 1, 70, 90, 64, 576, 32, 2048
    args = (sds((nb, s_q, h_i, 128), bf), sds((nb, s_kv, 128), bf), sds((nb, s_q, h_i), f32),
            sds((nb, s_q, h, d_qk), bf), sds((nb, s_kv, d_qk), bf), sds((nb, s_q), i32),
            sds((nb, s_kv), i32), sds((nb, s_q, k), i32), sds((nb, s_q, h), f32))

    def loss(iq, ik, iw, q, kv, qp, kp, idx, lse, scores=None):
        return cuda_op(iq, ik, iw, q, kv, sm_scale=0.07, q_positions=qp, kv_positions=kp,
                       indices=idx, attention_lse=lse, index_scores=scores,
                       implementation="cuda")

    for scores in (None, sds((nb, s_q, k), f32)):
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        text = f.trace(*args, scores).lower(lowering_platforms=("cuda",)).as_text()
        names = set(re.findall(r"stablehlo.custom_call @(\w+)", text))
        assert {"jax_dsa_sparse_mla_target_cuda", kl_loss_cuda.BWD_TARGET} <= names, names
        assert (kl_loss_cuda.SCORE_TARGET in names) == (scores is None), names
        assert kl_loss_cuda.FWD_TARGET not in names
        assert not re.search(rf"tensor<\d+x{k}x(128|{d_qk})x(bf16|f32)>", text)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_passes_a_scale_and_a_fixed_point_workspace(cuda_op, deterministic):
    """deterministic=True calls the backward kernel's deterministic target with fixed_scale [1]
    and a workspace of 8 bytes per d_ik element (its 64-bit sums) and 4 a row (the non-finite
    flags); False, the default target without them (the float32 atomics)."""
    nb, s_q, s_kv, h_i = 1, 40, 50, 32
    _, calls = _lower_cuda_grad(cuda_op, nb, s_q, s_kv, 64, 576, h_i, 64, deterministic)
    det_target = kl_loss_cuda.BWD_DET_TARGET
    targets = {c[0] for c in calls}
    assert (det_target in targets) == deterministic
    assert (kl_loss_cuda.BWD_TARGET in targets) != deterministic
    (bwd,) = [c for c in calls if c[0] in (det_target, kl_loss_cuda.BWD_TARGET)]
    _, _, _, operands, results = bwd
    if deterministic:
        assert operands.rstrip().endswith("tensor<1xf32>"), operands
        assert f"tensor<{nb * s_kv * (128 * 8 + 4)}xui8>" in results, results
    else:
        assert operands.rstrip().endswith(f"tensor<{s_q}x64xf32>"), operands  # dscore last
        assert "ui8" not in results, results


def test_deterministic_is_checked(cuda_op):
    with pytest.raises(TypeError, match="deterministic must be None or a Python bool"):
        _lower_cuda_grad(cuda_op, 1, 8, 8, 64, 576, 32, 8, deterministic="yes")


def test_fixed_point_scale_bounds_every_partial_sum():
    """2^F with bound * 2^F <= 2^62 < 2 * bound * 2^F; non-finite inputs are left out."""
    rng = np.random.default_rng(0)
    iq = jnp.asarray(rng.standard_normal((2, 16, 4, 128)) * 3, jnp.bfloat16)
    iw = jnp.asarray(rng.standard_normal((2, 16, 4)), jnp.float32)
    mass = jnp.asarray(np.abs(rng.standard_normal((2, 16))) * 50, jnp.float32)
    scale = kl_loss_cuda.fixed_point_scale(iq, iw, mass)
    bound = (np.sum(np.asarray(mass) * np.abs(np.asarray(iw)).sum(-1))
             * np.abs(np.asarray(iq, np.float32)).max() * 1.01)
    s = float(scale[0])
    assert np.log2(s) == np.round(np.log2(s))
    assert bound * s <= 2.0 ** 62 < 2 * bound * s
    poisoned = kl_loss_cuda.fixed_point_scale(iq.at[0, 0, 0, 0].set(jnp.nan), iw.at[1, 2, 3].set(
        jnp.inf), mass)
    assert float(poisoned[0]) >= s  # the finite terms' bound, no larger


@pytest.mark.parametrize("given_lse", [False, True])
def test_dense_grad_lowers_to_chunked_kernels(cuda_op, monkeypatch, given_lse):
    """The dense form under jax.grad: the index scores' log-sum-exp, then the target and the
    dense backward kernels on [S_q, 2048] chunks inside a loop (no score kernel, no second
    pass), the dense forward only without attention_lse, and no [S_q, S_kv] array anywhere."""
    monkeypatch.setattr(kl_loss_cuda, "native_unavailable", lambda *a: None)
    f32, bf, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sds = jax.ShapeDtypeStruct
    nb, s, h, d_qk, h_i = 1, 5000, 64, 576, 32
    args = (sds((nb, s, h_i, 128), bf), sds((nb, s, 128), bf), sds((nb, s, h_i), f32),
            sds((nb, s, h, d_qk), bf), sds((nb, s, d_qk), bf), sds((nb, s), i32),
            sds((nb, s, h), f32))

    def loss(iq, ik, iw, q, kv, pos, lse):
        return cuda_op(iq, ik, iw, q, kv, sm_scale=0.07, q_positions=pos, kv_positions=pos,
                       attention_lse=lse if given_lse else None, implementation="cuda")

    text = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    names = re.findall(r"stablehlo.custom_call @(\w+)", text)
    assert {"jax_dsa_sparse_mla_target_cuda", "jax_dsa_indexer_lse_cuda",
            kl_loss_cuda.DENSE_BWD_TARGET} <= set(names), names
    assert ("jax_dsa_dense_mla_fwd_cuda" in names) != given_lse
    assert names.count("jax_dsa_sparse_mla_target_cuda") == 1, names  # one pass over the keys
    assert not {kl_loss_cuda.FWD_TARGET, kl_loss_cuda.SCORE_TARGET,
                kl_loss_cuda.BWD_TARGET} & set(names), names
    assert "stablehlo.while" in text
    assert f"tensor<{s}x2048xf32>" in text  # the chunk
    assert not re.search(rf"tensor<(\d+x)*{s}x{s}(x\d+)*x", text)
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    (_, _, attrs, operands, results), = [c for c in calls if c[0] == kl_loss_cuda.DENSE_BWD_TARGET]
    assert operands.split(", ") == [f"tensor<{s}x{h_i}x128xbf16>", f"tensor<{s}x128xbf16>",
                                    f"tensor<{s}x{h_i}xf32>", f"tensor<{s}x2048xi32>",
                                    f"tensor<{s}x2048xf32>", f"tensor<{s}xf32>"], operands
    for want in (f"tensor<{s}x{h_i}x128xf32>", f"tensor<{s}x128xf32>", f"tensor<{s}x{h_i}xf32>",
                 f"tensor<{s}x2048xf32>"):
        assert want in results, (want, results)
    assert "s_q" in attrs and "s_kv" in attrs


# ---------------------------------------------------------------------------------------------
# On the GPU: the kernels against their contracts, the op against the float64 oracle


def _max_rel(got, want, mask=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if mask is not None:
        got, want = got[mask], want[mask]
    return float(np.abs(got - want).max(initial=0) / max(np.abs(want).max(initial=0), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k,segments", [
    (2, 40, 70, 80, 512, 5, 300, True),       # two head groups, K > S_kv, packed documents
    (1, 33, 3000, 64, 576, 32, 2048, False),  # GLM-5 dims
    (1, 20, 20, 16, 576, 64, 37, True),       # padded heads, H_I 64
])
def test_gpu_kernels_match_their_contracts(nb, s_q, s_kv, h, d_qk, h_i, k, segments):
    """The forward kernel's target mass and index scores and the backward kernel's gradients
    against their pure-JAX contracts (tests/cuda_doubles.py, float32 on the GPU), with -1 and
    out-of-range slots, duplicates and rows without support."""
    x = make_inputs(np.random.default_rng(k), nb, s_q, s_kv, h, d_qk, h_i, k, segments)
    args = tuple(None if x[n] is None else jnp.asarray(x[n]) for n in
                 ("iq", "ik", "iw", "q_pos", "kv_pos", "q_seg", "kv_seg", "q", "kv", "idx"))
    scale = d_qk ** -0.5
    mass, score = jax.jit(lambda *a: kl_loss_cuda.forward_kernel(*a, sm_scale=scale))(*args)
    want_mass, want_score = jax.jit(
        lambda *a: cuda_doubles.kl_forward_kernel(*a, sm_scale=scale))(*args)
    support = np.isfinite(np.asarray(want_score))
    np.testing.assert_array_equal(np.isfinite(np.asarray(score)), support)
    assert _max_rel(mass, want_mass) < 1e-4
    assert _max_rel(score, want_score, support) < 1e-4
    ds = np.random.default_rng(1).standard_normal(x["idx"].shape).astype(np.float32)
    ds = jnp.asarray(np.where(support, ds, 0))
    bwd_args = (args[0], args[1], args[2], args[9], ds)
    got = jax.jit(kl_loss_cuda.backward_kernel)(*bwd_args)
    want = jax.jit(cuda_doubles.kl_backward_kernel)(*bwd_args)
    assert np.all(np.isfinite(np.asarray(mass)))
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got, want):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert rel_l2(a, b) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k,dense", [
    (1, 2048, 2048, 64, 576, 32, 2048, False),  # GLM-5 dims
    (1, 2300, 2300, 16, 576, 32, None, True),   # the dense form, two chunks
])
def test_gpu_deterministic_grads_repeat_bitwise(nb, s_q, s_kv, h, d_qk, h_i, k, dense):
    """deterministic=True: two runs give bitwise identical gradients, as accurate as the
    default (float64 oracle); a NaN in one query's index_q poisons the d index_k rows that
    query selected, as the default's atomics do, and no other."""
    rng = np.random.default_rng(s_q + 5)
    x = (dense_inputs(rng, nb, s_q, s_kv, h, d_qk, h_i, segments=False) if dense
         else make_inputs(rng, nb, s_q, s_kv, h, d_qk, h_i, k, segments=False))
    sm_scale = d_qk ** -0.5

    def grads(iq, det=True):
        def loss(iq, ik, iw):
            return kl_loss.indexer_kl_loss(
                iq, ik, iw, x["q"], x["kv"], sm_scale=sm_scale, q_positions=x["q_pos"],
                kv_positions=x["kv_pos"], indices=None if dense else x["idx"],
                implementation="cuda", deterministic=det)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(iq, x["ik"], x["iw"])

    first, second = grads(x["iq"]), grads(x["iq"])
    ref = oracle.sparse_kl_loss(x, sm_scale, **({"block": 64} if dense else {}))
    for name, a, b, want in zip(("d_iq", "d_ik", "d_w"), first, second, ref[1:]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert rel_l2(a, want) <= 1e-2, name
    default = grads(x["iq"], det=False)
    assert rel_l2(first[1], default[1]) <= 1e-3  # the same sums, another rounding
    t = 3 if dense else 700
    poisoned = grads(jnp.asarray(x["iq"]).at[0, t, 0, 0].set(jnp.nan), det=True)
    want = grads(jnp.asarray(x["iq"]).at[0, t, 0, 0].set(jnp.nan), det=False)
    # Rows, not elements: the default leaves a NaN where its float32 sums met one, the fixed
    # point flags the whole row.
    nan_rows = np.isnan(np.asarray(poisoned[1])).any(-1)
    np.testing.assert_array_equal(nan_rows, np.isnan(np.asarray(want[1])).any(-1))
    assert 0 < nan_rows.sum() < s_kv


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_nan_in_index_q_propagates(deterministic):
    """relu keeps a NaN (as jax.nn.relu does; fmaxf would drop it): a NaN in one query's
    index_q makes the loss NaN, its own d index_q row NaN, and exactly the d index_k rows that
    query selected (valid, visible slots) NaN; every other gradient row stays finite."""
    rng = np.random.default_rng(11)
    s, t = 512, 300
    x = make_inputs(rng, 1, s, s, 64, 576, 32, 256, segments=False)
    iq = jnp.asarray(x["iq"]).at[0, t, 0, 0].set(jnp.nan)

    def loss(iq, ik, iw):
        return kl_loss.indexer_kl_loss(
            iq, ik, iw, x["q"], x["kv"], sm_scale=576 ** -0.5, q_positions=x["q_pos"],
            kv_positions=x["kv_pos"], indices=x["idx"], implementation="cuda",
            deterministic=deterministic)

    value, (d_iq, d_ik, d_w) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
        iq, x["ik"], x["iw"])
    assert np.isnan(float(value))
    row = x["idx"][0, t]
    selected = np.zeros(s, bool)
    selected[row[(row >= 0) & (row < s) & (row <= x["q_pos"][0, t])]] = True
    assert selected.sum() > 100
    np.testing.assert_array_equal(np.isnan(np.asarray(d_ik[0])).any(-1), selected)
    for name, g in (("d_iq", d_iq), ("d_w", d_w)):
        bad = ~np.isfinite(np.asarray(g[0])).reshape(s, -1).all(-1)
        np.testing.assert_array_equal(np.nonzero(bad)[0], [t], err_msg=name)


@pytest.fixture
def gpu_op():
    return kl_loss.indexer_kl_loss


@pytest.mark.gpu
@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k,segments", [
    (2, 512, 640, 64, 576, 32, 256, True),      # GLM-5 dims, packed documents
    (1, 1024, 1024, 64, 576, 32, 2048, False),  # GLM-5 dims, a full cluster of 8
    (1, 2048, 2048, 64, 576, 32, 512, True),    # GLM-5 dims, 2048 rows, packed documents
    (1, 600, 700, 80, 512, 64, 300, True),      # two head groups, H_I 64, partial CTAs
    (1, 600, 700, 128, 512, 64, 1000, True),    # 128 heads (V3.2 / V4-Pro), H_I 64
    (1, 300, 300, 16, 576, 7, 1000, False),     # padded heads, K > S_kv
])
def test_gpu_matches_float64_oracle(gpu_op, nb, s_q, s_kv, h, d_qk, h_i, k, segments):
    x = make_inputs(np.random.default_rng(s_q + k), nb, s_q, s_kv, h, d_qk, h_i, k, segments)
    sm_scale = d_qk ** -0.5
    loss, grads = loss_and_grads(gpu_op, x, sm_scale, "cuda")
    ref = oracle.sparse_kl_loss(x, sm_scale)
    assert abs(float(loss) - ref[0]) <= 1e-3 * abs(ref[0])
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), grads, ref[1:]):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert rel_l2(a, b) <= 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("nb,s,h,d_qk,h_i,segments,given_lse", [
    (1, 2300, 16, 576, 32, False, True),   # two chunks, the second partial
    (2, 700, 80, 512, 64, True, False),    # packed documents, two head groups, lse recomputed
])
def test_gpu_dense_matches_float64_oracle(gpu_op, nb, s, h, d_qk, h_i, segments, given_lse):
    x = dense_inputs(np.random.default_rng(s + h), nb, s, s, h, d_qk, h_i, segments,
                     shuffle=segments)
    sm_scale = d_qk ** -0.5
    lse = attention_lse(x, sm_scale) if given_lse else None
    loss, grads = loss_and_grads(gpu_op, x, sm_scale, "cuda", lse=lse)
    ref = oracle.sparse_kl_loss(x, sm_scale, block=64)
    assert abs(float(loss) - ref[0]) <= 1e-3 * abs(ref[0])
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), grads, ref[1:]):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert rel_l2(a, b) <= 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k,segments,given_scores", [
    (1, 1024, 1024, 64, 576, 32, 2048, False, True),  # GLM-5 dims, the layer's call
    (1, 600, 700, 80, 512, 64, 300, True, False),     # two head groups, packed documents
])
def test_gpu_given_lse_matches_float64_oracle(gpu_op, nb, s_q, s_kv, h, d_qk, h_i, k, segments,
                                              given_scores):
    """The target from the attention kernel's target mode (attention_lse given); the index
    scores given (index_scores, as the top-k returns them) or from the score kernel."""
    x = make_inputs(np.random.default_rng(s_q + k + 1), nb, s_q, s_kv, h, d_qk, h_i, k, segments)
    sm_scale = d_qk ** -0.5
    loss, grads = loss_and_grads(gpu_op, x, sm_scale, "cuda", lse=attention_lse(x, sm_scale),
                                 scores=slot_scores(x) if given_scores else None)
    ref = oracle.sparse_kl_loss(x, sm_scale)
    assert abs(float(loss) - ref[0]) <= 1e-3 * abs(ref[0])
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), grads, ref[1:]):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert rel_l2(a, b) <= 1e-2, name


# Launch-time experiments of kernel B (benchmarks/notes/indexer_kl_loss.md, session 40), until
# their measurement adopts or removes them: (variables, deterministic, whether d index_k must be
# bitwise the plain kernel's). Fixed-point sums are order-free and each slot's U is the same, so
# the deterministic variants must give the same d index_k bit for bit.
KL_BWD_VARIANTS = [
    ({"JAX_DSA_KL_DET_BULK": "1"}, True, True),
    ({"JAX_DSA_KL_SORT_WAVES": "force"}, False, False),
    ({"JAX_DSA_KL_DET_BULK": "1", "JAX_DSA_KL_SORT_WAVES": "force"}, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("env,det,same_d_ik", KL_BWD_VARIANTS)
def test_gpu_kernel_b_variants_match_the_plain_kernel(monkeypatch, env, det, same_d_ik):
    """Each variant against the plain kernel B of the same mode, and both against the float64
    oracle, at GLM-5's dims (H_I 32: the variants' kernels; T 2048: eight waves of 264 rows on an
    H100 under SORT_WAVES=force); with a NaN in one query's index_q, the same d index_k rows come
    out NaN as with the plain kernel."""
    rng = np.random.default_rng(23)
    x = make_inputs(rng, 1, 2048, 2048, 64, 576, 32, 2048, segments=False)
    poisoned_iq = jnp.asarray(x["iq"]).at[0, 700, 0, 0].set(jnp.nan)

    def grads(iq=x["iq"]):  # a new function each call: compiled, and so launched, under the env
        def loss(iq, ik, iw):
            return kl_loss.indexer_kl_loss(
                iq, ik, iw, x["q"], x["kv"], sm_scale=576 ** -0.5, q_positions=x["q_pos"],
                kv_positions=x["kv_pos"], indices=x["idx"], implementation="cuda",
                deterministic=det)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(iq, x["ik"], x["iw"])

    for var in env:
        monkeypatch.delenv(var, raising=False)
    plain, plain_nan = grads(), grads(poisoned_iq)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    got, again, got_nan = grads(), grads(), grads(poisoned_iq)
    nan_rows = np.isnan(np.asarray(got_nan[1])).any(-1)
    np.testing.assert_array_equal(nan_rows, np.isnan(np.asarray(plain_nan[1])).any(-1))
    assert 0 < nan_rows.sum() < nan_rows.size
    ref = oracle.sparse_kl_loss(x, 576 ** -0.5)
    for name, a, b, want in zip(("d_iq", "d_ik", "d_w"), got, plain, ref[1:]):
        assert rel_l2(a, want) <= 1e-2, name
        assert rel_l2(a, b) <= 1e-3, name
    if det:
        for a, b in zip(got, again):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if same_d_ik:
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(plain[1]))
