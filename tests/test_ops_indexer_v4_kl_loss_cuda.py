"""v4_indexer_kl_loss(implementation="cuda"): DeepSeek V4's KL loss on SM90
(jax_dsa/ops/indexer/v4_kl_loss/cuda.py; the forward kernel's given-denominator mode, the
backward kernel shared with V3.2's loss).

On any machine: the registry and supported(); the XLA glue around the kernels, with the kernels'
pure-JAX contracts (tests/cuda_doubles.py) monkeypatched in, against the "xla" implementation
and the float64 oracle (tests/oracle.py)
(values, gradients; -1 and out-of-range slots, duplicates, empty rows, packed documents, batch 2,
rows whose compressed mass is 1e-30 and 1e-44 of the window and sink mass; head and sequence
sharding on a CPU mesh); the CUDA lowering of jax.grad (our custom calls with the kernels'
operand shapes, no gather of [S, K, .] rows in XLA). The ``gpu`` tests (an SM90 GPU, ``make
test-gpu``): the loss and gradients against the float64 oracle on bf16-rounded inputs at
V4-Flash and V4-Pro dims, sparse and dense.
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
from jax_dsa.ops.indexer.kl_loss import cuda as kl_loss_cuda
from jax_dsa.ops.indexer.v4_kl_loss import op as v4_kl_loss
from jax_dsa.ops.indexer.v4_kl_loss import cuda as v4_kl_loss_cuda
from jax_dsa.ops.indexer.kl_loss.config import KLCall
from jax_dsa.ops.registry import Unavailable
from oracle import rel_l2
from test_ops_indexer_kl_loss_cuda import add_invalid_slots

BF16 = ml_dtypes.bfloat16


def bf16_round(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


@pytest.fixture
def cuda_op(monkeypatch):
    """v4_indexer_kl_loss with "cuda" selectable whatever this install built (lowering and glue
    tests need no GPU and no kernels)."""
    monkeypatch.setattr(v4_kl_loss_cuda, "module_error", lambda: None)
    return v4_kl_loss.v4_indexer_kl_loss


@pytest.fixture
def reference_kernels(cuda_op, monkeypatch):
    """The kernels' pure-JAX contracts in place of the FFI calls (runs anywhere)."""
    monkeypatch.setattr(v4_kl_loss_cuda, "forward_kernel", cuda_doubles.v4_forward_kernel)
    monkeypatch.setattr(kl_loss_cuda, "backward_kernel", cuda_doubles.kl_backward_kernel)
    return cuda_op


# ---------------------------------------------------------------------------------------------
# The registry and supported()


def test_registry_prefers_cuda_on_gpu():
    reg = v4_kl_loss.REGISTRY
    assert reg.names == ("xla", "cuda")
    assert reg.preference("gpu") == ("cuda", "xla")
    assert reg.preference("cpu") == ("xla",)
    assert reg.restrict(None) is None
    # its names first (another op's "cpu" skipped), then the default order, without repeats
    assert reg.restrict(("cuda", "cpu")) == tuple(dict.fromkeys(("cuda",) + reg.preference()))


def _call(**over):
    a = dict(dtype=np.dtype(np.float32), index_n_heads=64, index_head_dim=128, h=64, d_qk=512,
             s_q=512, s_kv=128, topk=512, segments=False)
    a.update(over)
    return KLCall(**a)


@pytest.mark.parametrize("over,match", [
    (dict(d_qk=128), "D_qk"),
    (dict(index_n_heads=128), "at most 64 index heads"),
    (dict(h=256), "at most 128 heads"),
    (dict(topk=4096), "at most 2048 slots"),
    (dict(dtype=np.dtype(np.float64)), "float64"),
])
def test_supported_gives_the_rule(over, match):
    why = v4_kl_loss_cuda.supported(_call(**over))
    assert why is not None and re.search(match, why), why
    assert not isinstance(why, Unavailable)


def test_supported_takes_v4_dims(monkeypatch):
    why = v4_kl_loss_cuda.supported(_call())
    if v4_kl_loss_cuda.module_error() is not None:
        assert isinstance(why, Unavailable) and "_cuda_indexer" in why
    monkeypatch.setattr(v4_kl_loss_cuda, "module_error", lambda: None)
    for over in ({}, dict(h=128, topk=1024)):  # V4-Flash, V4-Pro
        why = v4_kl_loss_cuda.supported(_call(**over))
        assert why is None or "SM90" in why, why


# ---------------------------------------------------------------------------------------------
# Inputs (the float64 oracle: tests/oracle.py)


def make_inputs(rng, nb, s_q, s_kv, h, d_qk, h_i, k, sm_scale, segments=True, block=16,
                dense=False):
    """bf16-representable float32 inputs with -1 and out-of-range slots, duplicates, rows
    without support, packed documents, and attention_lse = log(window and sink mass + the
    support's exp-logits) per head; in rows t % 5 == 2 every head's compressed mass is ~1e-44 of
    the rest (below float32's normal range), in rows t % 5 == 3 ~1e-30, in rows t % 5 == 4 half
    of the heads' is ~1e-44. ``dense``: ``idx`` every entry (the dense form's support, for the
    oracle; the op gets ``indices=None``)."""
    iq = bf16_round(rng.standard_normal((nb, s_q, h_i, 128)))
    ik = bf16_round(rng.standard_normal((nb, s_kv, 128)))
    iw = (rng.standard_normal((nb, s_q, h_i)) * h_i ** -0.5 * 128 ** -0.5).astype(np.float32)
    q = bf16_round(rng.standard_normal((nb, s_q, h, d_qk)))
    kv = bf16_round(rng.standard_normal((nb, s_kv, d_qk)))
    off = s_kv - s_q if s_kv >= s_q else 0
    q_pos = np.tile(np.arange(s_q, dtype=np.int32) + off, (nb, 1))
    kv_pos = np.tile(np.arange(s_kv, dtype=np.int32), (nb, 1))
    q_seg = kv_seg = None
    if segments:
        kv_seg = np.zeros((nb, s_kv), np.int32)
        cut = s_kv // 3
        kv_seg[:, cut:] = 1
        kv_pos[:, cut:] -= cut
        q_glob = np.arange(s_q) + off
        q_seg = (q_glob >= cut).astype(np.int32)[None].repeat(nb, 0)
        q_pos = np.where(q_seg == 1, q_glob - cut, q_glob).astype(np.int32)
    glob = np.arange(s_q) + off
    idx = (rng.random((nb, s_q, k)) * (np.minimum(glob, s_kv - 1)[None, :, None] + 1)).astype(
        np.int32)
    if dense:
        idx = np.broadcast_to(np.arange(s_kv, dtype=np.int32), (nb, s_q, s_kv)).copy()
    else:
        add_invalid_slots(rng, idx, s_kv)
    x = dict(iq=iq, ik=ik, iw=iw, q=q, kv=kv, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg,
             kv_seg=kv_seg, idx=idx)
    # The window and sink mass (natural log, per head), then the shifts of the underflow rows.
    extra = rng.standard_normal((nb, s_q, h)) * 1.5 + 2.0
    lse = np.empty((nb, s_q, h))
    t = np.arange(s_q)
    for b in range(nb):
        for t0 in range(0, s_q, block):
            t1 = min(s_q, t0 + block)
            _, _, logits = oracle.support_logits(x, b, t0, t1, sm_scale)
            lse_sup = oracle.logsumexp(logits, -1)  # [n, H]; -inf on empty rows
            top = np.max(np.where(np.isfinite(lse_sup), lse_sup, 0), axis=-1, keepdims=True)
            e = extra[b, t0:t1]
            tt = t[t0:t1, None]
            e = np.where(tt % 5 == 2, top + 100.0, e)
            e = np.where(tt % 5 == 3, top + 69.0, e)
            e = np.where((tt % 5 == 4) & (np.arange(h)[None] % 2 == 0), top + 100.0, e)
            lse[b, t0:t1] = np.logaddexp(lse_sup, e)
    x["lse"] = lse.astype(np.float32)
    return x


def loss_fn(op, sm_scale, impl, dense=False, deterministic=None):
    """jit(value_and_grad) of the loss in (index_q, index_k, index_weights), taking the input
    dict (every tensor an argument: one compile per shape); ``dense``: the dense form."""

    def loss(iq, ik, iw, x):
        return op(iq, ik, iw, x["q"], x["kv"], x["lse"], sm_scale=sm_scale,
                  q_positions=x["q_pos"], kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"],
                  kv_segment_ids=x["kv_seg"], indices=None if dense else x["idx"],
                  implementation=impl, deterministic=deterministic)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return lambda x: f(x["iq"], x["ik"], x["iw"], x)


def assert_same(got_l, got_g, want_l, want_g, tol):
    """Loss within ``tol`` relative, each gradient within ``tol`` relative L2."""
    np.testing.assert_allclose(got_l, want_l, rtol=tol)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, want_g):
        assert rel_l2(a, b) < tol, name


def loss_and_grads(op, x, sm_scale, impl, dense=False, deterministic=None):
    return loss_fn(op, sm_scale, impl, dense, deterministic)(x)


# ---------------------------------------------------------------------------------------------
# The glue, with the kernels' contracts (any machine)


@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k", [
    (2, 24, 40, 80, 512, 5, 37),   # two head groups (80 = 64 + 16), odd K, batch 2
    (1, 17, 17, 3, 576, 32, 300),  # K > S_kv: many duplicates
    (1, 20, 12, 64, 512, 64, 16),  # V4-Flash heads and index heads
])
def test_glue_matches_xla_and_oracle(reference_kernels, nb, s_q, s_kv, h, d_qk, h_i, k):
    sm_scale = d_qk ** -0.5
    x = make_inputs(np.random.default_rng(k), nb, s_q, s_kv, h, d_qk, h_i, k, sm_scale)
    got_l, got_g = loss_and_grads(reference_kernels, x, sm_scale, "cuda")
    want_l, want_g = loss_and_grads(reference_kernels, x, sm_scale, "xla")
    ref = oracle.v4_kl_loss(x, sm_scale)
    for want in ((want_l, want_g), (ref[0], ref[1:])):
        assert_same(got_l, got_g, *want, tol=2e-5)


def test_glue_underflowing_compressed_mass_is_exact(reference_kernels):
    """Every row's compressed mass ~1e-44 (and, shifted, ~1e-30) of its window and sink mass:
    below float32's normal range in linear space, yet the per-row renormalised target (and so
    the loss and gradients) equals the unshifted one and the float64 oracle."""
    sm_scale = 512 ** -0.5
    x = make_inputs(np.random.default_rng(5), 2, 20, 24, 64, 512, 16, 24, sm_scale)
    base = x["lse"].astype(np.float64)
    x_hi = dict(x, lse=(base + 100.0).astype(np.float32))
    assert np.max(np.exp(-100.0)) < np.finfo(np.float32).tiny  # the mass itself underflows
    f = loss_fn(reference_kernels, sm_scale, "cuda")
    want_l, want_g = f(x)
    for shift in (69.0, 100.0):
        xs = dict(x, lse=(base + shift).astype(np.float32))
        got_l, got_g = f(xs)
        assert float(got_l) > 0
        np.testing.assert_allclose(got_l, want_l, rtol=1e-4)
        for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, want_g):
            assert rel_l2(a, b) < 1e-4, name
    ref = oracle.v4_kl_loss(x_hi, sm_scale)
    got_l, got_g = f(x_hi)
    np.testing.assert_allclose(got_l, ref[0], rtol=2e-5)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, ref[1:]):
        assert rel_l2(a, b) < 2e-5, name


def test_glue_without_any_support_is_zero(reference_kernels):
    x = make_inputs(np.random.default_rng(0), 1, 8, 8, 4, 512, 2, 6, 0.1)
    x["idx"][:] = -1
    loss, grads = loss_and_grads(reference_kernels, x, 0.1, "cuda")
    assert float(loss) == 0.0
    for g in grads:
        assert not np.any(np.asarray(g))


@pytest.mark.parametrize("sizes", [{"tp": 2}, {"dp": 2, "cp": 2, "tp": 2}])
def test_glue_under_sharding_matches_unsharded(reference_kernels, sizes):
    """Heads (and attention_lse) split over tp (the target's log-sum-exp over heads spans the
    shards), rows over cp, batch over dp: the same loss and gradients as unsharded."""
    n = int(np.prod(list(sizes.values())))
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices")
    x = make_inputs(np.random.default_rng(3), 2, 16, 16, 8, 512, 4, 9, 0.2)
    want_l, want_g = loss_and_grads(reference_kernels, x, 0.2, "cuda")
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(AxisType.Auto,) * len(sizes), devices=jax.devices()[:n])

    def sp(*dims):
        return jax.sharding.NamedSharding(mesh, P(*(d if d in mesh.axis_names else None
                                                    for d in dims)))

    put = dict(iq=sp("dp", "cp", None, None), ik=sp("dp", "cp", None), iw=sp("dp", "cp", None),
               q=sp("dp", "cp", "tp", None), kv=sp("dp", "cp", None), q_pos=sp("dp", "cp"),
               kv_pos=sp("dp", "cp"), q_seg=sp("dp", "cp"), kv_seg=sp("dp", "cp"),
               idx=sp("dp", "cp", None), lse=sp("dp", "cp", "tp"))
    with jax.set_mesh(mesh):
        xs = {k: jax.device_put(v, put[k]) for k, v in x.items()}
        got_l, got_g = loss_and_grads(reference_kernels, xs, 0.2, "cuda")
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), got_g, want_g):
        assert rel_l2(a, b) < 1e-5, name


@pytest.mark.parametrize("segments", [False, True])
def test_dense_glue_matches_xla_and_oracle(reference_kernels, monkeypatch, segments):
    """The dense form over several chunks (CHUNK cut to 8: rows span 1-5 chunks), with rows whose
    compressed mass underflows float32 next to the window and sink, packed documents, batch 2."""
    monkeypatch.setattr(kl_loss_cuda, "CHUNK", 8)
    sm_scale = 512 ** -0.5
    x = make_inputs(np.random.default_rng(21), 2, 24, 36, 80, 512, 5, 1, sm_scale, segments,
                    dense=True)
    x_op = {k: v for k, v in x.items() if k != "idx"}
    x_op["idx"] = None
    got_l, got_g = loss_and_grads(reference_kernels, x_op, sm_scale, "cuda", dense=True)
    want_l, want_g = loss_and_grads(reference_kernels, x_op, sm_scale, "xla", dense=True)
    ref = oracle.v4_kl_loss(x, sm_scale)
    for want in ((want_l, want_g), (ref[0], ref[1:])):
        assert_same(got_l, got_g, *want, tol=2e-5)


def test_dense_glue_lowers_to_chunked_kernels(cuda_op, monkeypatch):
    monkeypatch.setattr(v4_kl_loss_cuda, "sm90_device_error", lambda: None)
    f32, bf, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sds = jax.ShapeDtypeStruct
    s_q, s_c, h, h_i = 4096, 3000, 64, 64
    args = (sds((1, s_q, h_i, 128), bf), sds((1, s_c, 128), bf), sds((1, s_q, h_i), f32),
            sds((1, s_q, h, 512), bf), sds((1, s_c, 512), bf), sds((1, s_q, h), f32),
            sds((1, s_q), i32), sds((1, s_c), i32))

    def loss(iq, ik, iw, q, kv, lse, qp, kp):
        return cuda_op(iq, ik, iw, q, kv, lse, sm_scale=0.07, q_positions=qp, kv_positions=kp,
                       implementation="cuda")

    text = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(*args)
            .lower(lowering_platforms=("cuda",)).as_text())
    names = set(re.findall(r"stablehlo.custom_call @(\w+)", text))
    assert {v4_kl_loss_cuda.FWD_TARGET, v4_kl_loss_cuda.BWD_TARGET} <= names, names
    assert "stablehlo.while" in text and f"tensor<{s_q}x2048xf32>" in text
    assert f"{s_q}x{s_c}x" not in text  # no [S_q, S_kv] value


# ---------------------------------------------------------------------------------------------
# CUDA lowering (no GPU needed)


def _lower_cuda_grad(op, nb, s_q, s_kv, h, d_qk, h_i, k, deterministic=None):
    f32, bf, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    sds = jax.ShapeDtypeStruct
    iq, ik, iw = sds((nb, s_q, h_i, 128), bf), sds((nb, s_kv, 128), bf), sds((nb, s_q, h_i), f32)
    q, kv, lse = sds((nb, s_q, h, d_qk), bf), sds((nb, s_kv, d_qk), bf), sds((nb, s_q, h), f32)
    qp, kp, idx = sds((nb, s_q), i32), sds((nb, s_kv), i32), sds((nb, s_q, k), i32)

    def loss(iq, ik, iw, q, kv, lse, qp, kp, idx):
        return op(iq, ik, iw, q, kv, lse, sm_scale=0.07, q_positions=qp, kv_positions=kp,
                  q_segment_ids=qp // 64, kv_segment_ids=kp // 64, indices=idx,
                  implementation="cuda", deterministic=deterministic)

    text = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            .trace(iq, ik, iw, q, kv, lse, qp, kp, idx).lower(lowering_platforms=("cuda",))
            .as_text())
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    return text, calls


@pytest.mark.parametrize("h,d_qk,h_i,k", [(64, 512, 64, 512), (128, 512, 64, 1024),
                                          (100, 576, 32, 300)])
def test_grad_lowers_to_the_kernels(cuda_op, h, d_qk, h_i, k):
    nb, s_q, s_kv = 2, 70, 90
    text, calls = _lower_cuda_grad(cuda_op, nb, s_q, s_kv, h, d_qk, h_i, k)
    fwd = [c for c in calls if c[0] == v4_kl_loss_cuda.FWD_TARGET]
    bwd = [c for c in calls if c[0] == v4_kl_loss_cuda.BWD_TARGET]
    # The forward kernel in the forward and again in the backward (identical: XLA merges them).
    assert len(fwd) == 2 and len(bwd) == 1, sorted(set(c[0] for c in calls))
    assert kl_loss_cuda.FWD_TARGET not in [c[0] for c in calls]  # not V3.2's two-pass mode
    assert fwd[0][2:] == fwd[1][2:]  # same attributes and operand types
    t, groups = nb * s_q, -(-h // 64)
    _, _, attrs, operands, results = fwd[0]
    for want in (f"tensor<{t}x{h}x{d_qk}xbf16>", f"tensor<{nb * s_kv}x{d_qk}xbf16>",
                 f"tensor<{t}x{h_i}x128xbf16>", f"tensor<{nb * s_kv}x128xbf16>",
                 f"tensor<{t}x{h_i}xf32>", f"tensor<{t}x{k}xi32>", f"tensor<{t}xi32>",
                 f"tensor<{t}x{h}xf32>"):  # ... and attention_lse
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


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_calls_the_fixed_point_backward(cuda_op, deterministic):
    """deterministic=True: V3.2's deterministic backward target (d index_k in 64-bit fixed
    point, a scale operand and a workspace); False: the float32-atomic target."""
    nb, s_q, s_kv = 1, 40, 50
    _, calls = _lower_cuda_grad(cuda_op, nb, s_q, s_kv, 64, 512, 64, 64, deterministic)
    targets = {c[0] for c in calls}
    assert (kl_loss_cuda.BWD_DET_TARGET in targets) == deterministic, targets
    assert (kl_loss_cuda.BWD_TARGET in targets) != deterministic, targets
    (bwd,) = [c for c in calls if c[0] in (kl_loss_cuda.BWD_DET_TARGET, kl_loss_cuda.BWD_TARGET)]
    assert ("ui8" in bwd[4]) == deterministic, bwd[4]


# ---------------------------------------------------------------------------------------------
# On the GPU: the kernels against the float64 oracle


@pytest.fixture
def gpu_op():
    return v4_kl_loss.v4_indexer_kl_loss


def assert_near_oracle(label, loss, grads, ref):
    """The issue's bounds against the float64 oracle: loss rel <= 1e-3, finite gradients with
    rel L2 <= 1e-2 (printed, for the GPU logs)."""
    rel = abs(float(loss) - ref[0]) / abs(ref[0])
    errs = {n: rel_l2(a, b) for n, a, b in zip(("d_iq", "d_ik", "d_w"), grads, ref[1:])}
    print(f"{label}: loss {float(loss):.6g} oracle {ref[0]:.6g} rel {rel:.2e} grads rel L2 {errs}")
    assert rel <= 1e-3
    for name, a in zip(("d_iq", "d_ik", "d_w"), grads):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert errs[name] <= 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("nb,s_q,s_kv,h,d_qk,h_i,k,segments", [
    (2, 256, 320, 64, 512, 64, 512, True),     # V4-Flash dims, packed documents, batch 2
    (1, 128, 1100, 128, 512, 64, 1024, False),  # V4-Pro dims: two head groups, 4 CTAs a row
    (1, 200, 200, 80, 512, 7, 300, True),      # padded heads, partial CTAs, K > S_kv
])
def test_gpu_matches_float64_oracle(gpu_op, nb, s_q, s_kv, h, d_qk, h_i, k, segments):
    sm_scale = d_qk ** -0.5
    x = make_inputs(np.random.default_rng(s_q + k), nb, s_q, s_kv, h, d_qk, h_i, k, sm_scale,
                    segments)
    loss, grads = loss_and_grads(gpu_op, x, sm_scale, "cuda")
    assert_near_oracle(f"v4 kl cuda {nb}x{s_q}x{s_kv} h={h} k={k}", loss, grads,
                       oracle.v4_kl_loss(x, sm_scale))


@pytest.mark.gpu
def test_gpu_underflowing_compressed_mass(gpu_op):
    """All rows' compressed mass ~1e-44 of the window and sink: the kernel's log mass keeps the
    target exact (same loss as unshifted, and as the oracle)."""
    sm_scale = 512 ** -0.5
    x = make_inputs(np.random.default_rng(9), 1, 128, 160, 64, 512, 64, 512, sm_scale)
    xs = dict(x, lse=(x["lse"].astype(np.float64) + 100.0).astype(np.float32))
    loss, grads = loss_and_grads(gpu_op, xs, sm_scale, "cuda")
    assert_near_oracle("v4 kl cuda underflow", loss, grads, oracle.v4_kl_loss(xs, sm_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [False, True])
def test_gpu_dense_matches_float64_oracle(gpu_op, segments):
    """The dense form: 2500 compressed entries (two chunks of 2048, the second partial), V4-Flash
    heads; packed documents."""
    sm_scale = 512 ** -0.5
    x = make_inputs(np.random.default_rng(31 + segments), 1, 600, 2500, 64, 512, 64, 1,
                    sm_scale, segments, block=64, dense=True)
    x_op = {k: v for k, v in x.items() if k != "idx"}
    x_op["idx"] = None
    loss, grads = loss_and_grads(gpu_op, x_op, sm_scale, "cuda", dense=True)
    assert_near_oracle(f"v4 dense kl cuda segments={segments}", loss, grads,
                       oracle.v4_kl_loss(x, sm_scale, block=64))


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True])
def test_gpu_deterministic_grads_repeat_bitwise(gpu_op, dense):
    """deterministic=True at V4-Flash dims: two runs give bitwise identical gradients, as near
    the float64 oracle as the default's, and the default's within float32 rounding."""
    sm_scale = 512 ** -0.5
    if dense:
        x = make_inputs(np.random.default_rng(41), 1, 600, 2500, 64, 512, 64, 1, sm_scale,
                        True, block=64, dense=True)
        ref = oracle.v4_kl_loss(x, sm_scale, block=64)
        x = dict(x, idx=None)
    else:
        x = make_inputs(np.random.default_rng(43), 2, 256, 320, 64, 512, 64, 512, sm_scale, True)
        ref = oracle.v4_kl_loss(x, sm_scale)
    run = loss_fn(gpu_op, sm_scale, "cuda", dense, deterministic=True)
    (loss, first), (_, second) = run(x), run(x)
    for name, a, b in zip(("d_iq", "d_ik", "d_w"), first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert_near_oracle(f"v4 kl cuda deterministic dense={dense}", loss, first, ref)
    _, default = loss_and_grads(gpu_op, x, sm_scale, "cuda", dense)
    assert rel_l2(first[1], default[1]) <= 1e-3  # the same sums, another rounding
