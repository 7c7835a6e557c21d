"""indexer_topk(implementation="cuda"): the SM90 kernels of ffi/cuda/indexer (module
jax_dsa._cuda_indexer).

Without a GPU (CI): the module loads or says why, the glue's workspace formula is the handler's,
``supported`` gives the rule of each refusal, and the op lowers for CUDA to the one custom call
(no sort or top-k over [S_q, S_kv] left in the program). On an SM90 GPU also the numerics (the
full GPU check with timing is benchmarks/gpu_check_indexer_topk.py and gpu_indexer_topk.py).
"""

import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa.ops import registry
from jax_dsa import _native, indexer_topk
from jax_dsa.ops.indexer.topk import op as topk_module
from jax_dsa.ops.indexer.topk import cuda as tc
from jax_dsa.ops.indexer.topk.config import TopkCall
from jax_dsa.ops.registry import Unavailable

LOADED = tc.module_error() is None
needs_module = pytest.mark.skipif(not LOADED, reason=f"_cuda_indexer not built: {tc.module_error()}")


def _on_sm90():
    if not LOADED or jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an SM90 GPU and _cuda_indexer")


def test_module_loads_or_reports_why():
    if LOADED:
        mod = _native._MODULES[tc.MODULE]
        assert tuple(mod.FFI_API_VERSION) == (0, 4)
        assert tc.TARGET in mod.registrations()
        lim = mod.topk_limits()
        assert lim["head_dim"] == tc.KERNEL_HEAD_DIM
        assert tuple(lim["heads"]) == tc.KERNEL_HEADS
        assert lim["max_topk"] == tc.MAX_TOPK and lim["max_s_kv"] == tc.MAX_S_KV
        assert lim["key_tile"] == tc.KEY_TILE and lim["row_tile"] == tc.ROW_TILE
    else:
        assert tc.module_error()
        assert shutil.which("nvcc") is None or tc.MODULE in _native.LOAD_ERRORS


def test_registered_in_the_op():
    assert "cuda" in topk_module.REGISTRY, "topk.REGISTRY lacks topk_cuda.IMPLEMENTATION"
    assert topk_module.REGISTRY["cuda"] is tc.IMPLEMENTATION


@needs_module
@pytest.mark.parametrize("s_kv,rows", [(1, 8), (63, 8), (64, 16), (1000, 104), (131072, 2048),
                                       (131073, 2040)])
def test_workspace_formula_matches_the_handler(s_kv, rows):
    mod = _native._MODULES[tc.MODULE]
    assert mod.topk_workspace_bytes(s_kv, rows) == tc.workspace_bytes(s_kv, rows)


@needs_module
@pytest.mark.parametrize("s_kv,s_q", [(1, 1), (1000, 104), (131073, 20000)])
def test_index_lse_workspace_formula_matches_the_handler(s_kv, s_q):
    mod = _native._MODULES[tc.MODULE]
    assert mod.index_lse_workspace_bytes(s_kv, s_q) == tc.index_lse_workspace_bytes(s_kv, s_q)


@pytest.mark.parametrize("s_q,s_kv", [(1, 1), (100, 1000), (32768, 32768), (4096, 131072),
                                      (5, 1 << 21)])
def test_chunk_rows_bound_the_workspace(s_q, s_kv):
    rows = tc.chunk_rows(s_q, s_kv)
    assert rows % tc.ROW_TILE == 0 and rows >= tc.ROW_TILE
    assert rows <= -(-s_q // 8) * 8
    ld = -(-s_kv // 64) * 64
    assert rows == tc.ROW_TILE or rows * ld * 4 <= tc.WORKSPACE_LIMIT


def _call(**kw):
    base = dict(dtype=np.dtype(np.float32), index_n_heads=32, index_head_dim=128, s_q=100,
                s_kv=1000, topk=2048, segments=False)
    base.update(kw)
    return TopkCall(**base)


@pytest.mark.parametrize("change,match", [
    (dict(index_head_dim=64), "index_head_dim 128"),
    (dict(index_n_heads=65), "at most 64 index heads"),
    (dict(topk=2049), "topk <= 2048"),
    (dict(s_kv=(1 << 21) + 1), "S_kv <="),
    (dict(dtype=np.dtype(np.float64)), "float64"),
])
def test_supported_refuses_with_the_rule(change, match):
    why = tc.supported(_call(**change))
    assert why is not None and re.search(match, why), why
    assert not isinstance(why, Unavailable)


def test_supported_takes_the_layer_calls():
    for h in (1, 16, 20, 32, 48, 64):
        for dt in (np.float32, jnp.bfloat16, np.float16):
            why = tc.supported(_call(index_n_heads=h, dtype=np.dtype(dt), segments=True))
            if LOADED:
                assert why is None, why
            else:
                assert isinstance(why, Unavailable)


def test_unbuilt_module_is_unavailable(monkeypatch):
    monkeypatch.setattr(tc, "module_error", lambda: Unavailable(
        "implementation='cuda' is not available in this jax_dsa (not built)"))
    why = tc.supported(_call())
    assert isinstance(why, Unavailable) and "not available" in why


@pytest.mark.parametrize("cc,ok", [("9.0", True), ("8.0", False), ("10.0", False),
                                   ("12.0", False)])
def test_device_rule(monkeypatch, cc, ok):
    class Dev:
        compute_capability = cc

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
    why = registry.sm90_device_error()
    assert (why is None) == ok, why
    if not ok:
        assert "SM90" in why and cc in why


def _lower(b, s_q, s_kv, h, topk, segments, qk_dtype=None):
    sds = jax.ShapeDtypeStruct
    args = [sds((b, s_q, h, 128), jnp.bfloat16), sds((b, s_kv, 128), jnp.bfloat16),
            sds((b, s_q, h), jnp.float32), sds((b, s_q), jnp.int32), sds((b, s_kv), jnp.int32)]
    if segments:
        args += [sds((b, s_q), jnp.int32), sds((b, s_kv), jnp.int32)]

    def f(q, k, w, qp, kp, qs=None, ks=None):
        return indexer_topk(q, k, w, topk=topk, q_positions=qp, kv_positions=kp,
                            q_segment_ids=qs, kv_segment_ids=ks, qk_dtype=qk_dtype,
                            implementation="cuda")

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    return text, calls


@needs_module
@pytest.mark.parametrize("b,s_q,s_kv,h,topk,hp,segments", [
    (2, 70, 90, 20, 16, 32, False),
    (1, 300, 4096, 64, 2048, 64, True),
    (3, 33, 20, 48, 2048, 64, False),  # topk > S_kv: the op pads the rest with -1
])
def test_lowers_to_the_custom_call(b, s_q, s_kv, h, topk, hp, segments):
    text, calls = _lower(b, s_q, s_kv, h, topk, segments)
    ours = [c for c in calls if c[0] == tc.TARGET]
    assert len(ours) == 1, [c[0] for c in calls]
    _, _, attrs, operand_types, result_types = ours[0]
    k_eff = min(topk, s_kv)
    assert f"tensor<{b}x{s_q}x{hp}x128xbf16>" in operand_types
    assert f"tensor<{b}x{s_kv}x128xbf16>" in operand_types
    assert f"tensor<{b}x{s_q}x{hp}xf32>" in operand_types
    assert operand_types.count(f"tensor<{b}x{s_q}xi32>") == 2  # positions and segment ids
    rows = tc.chunk_rows(s_q, s_kv)
    assert f"tensor<{b}x{s_q}x{k_eff}xi32>" in result_types
    assert "tensor<0x0x0xf32>" in result_types  # no scores asked for
    assert f"tensor<{tc.workspace_bytes(s_kv, rows)}xui8>" in result_types
    assert f"chunk_rows = {rows}" in attrs
    # No dense selection left in the program: no sort, no top-k.
    assert "stablehlo.sort" not in text
    assert "top_k" not in text.lower() and "topk" not in re.sub(r"jax_dsa_indexer_topk_cuda", "",
                                                                 text).lower()
    assert f"{s_q}x{s_kv}x" not in text.replace(f"{s_q}x{s_kv}xi32", "")  # no [S_q, S_kv] value


@needs_module
def test_fp8_scores_lower_to_the_same_bf16_call():
    # fp8 values times power-of-two scales are exact in bfloat16: the bf16 kernel takes them
    b, s_q, s_kv, h = 2, 70, 90, 20
    text, calls = _lower(b, s_q, s_kv, h, 16, False, "float8_e4m3fn")
    ours = [c for c in calls if c[0] == tc.TARGET]
    assert len(ours) == 1, [c[0] for c in calls]
    assert f"tensor<{b}x{s_q}x32x128xbf16>" in ours[0][3]
    assert "f8E4M3FN" in text  # the quantization happened before the call


def test_wrong_sizes_raise_before_lowering():
    q = jnp.zeros((4, 2, 64), jnp.bfloat16)
    k = jnp.zeros((6, 64), jnp.bfloat16)
    w = jnp.zeros((4, 2), jnp.float32)
    pos = jnp.arange(4), jnp.arange(6)
    with pytest.raises((ValueError, NotImplementedError), match="index_head_dim 128|not available"):
        jax.eval_shape(lambda q, k, w: indexer_topk(q, k, w, topk=2, q_positions=pos[0],
                                                    kv_positions=pos[1], implementation="cuda"),
                       q, k, w)


# ---------------------------------------------------------------------------------------------
# On an SM90 GPU


def _oracle(q, k, w):
    dots = np.einsum("thd,sd->ths", q.astype(np.float64), k.astype(np.float64))
    score = np.einsum("ths,th->ts", np.maximum(dots, 0), w.astype(np.float64))
    bound = np.einsum("th,thd->td", np.abs(w.astype(np.float64)), np.abs(q.astype(np.float64)))
    return score, bound @ np.abs(k.astype(np.float64)).T * 4e-5 + 1e-30


def _bf(x):
    return np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # writable copy


def _gpu_inputs(h, s_q, s_kv):
    """Fresh bf16-representable ``q [S_q, h, 128]``, ``k [S_kv, 128]``, float32 ``w``, the
    queries as the last ``S_q`` of ``S_kv`` positions, and the op's device arguments."""
    rng = np.random.default_rng()
    q = _bf(rng.standard_normal((s_q, h, 128)) * 0.5)
    k = _bf(rng.standard_normal((s_kv, 128)))
    w = (rng.standard_normal((s_q, h)) * 0.02).astype(np.float32)
    qp, kp = np.arange(s_q) + (s_kv - s_q), np.arange(s_kv)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(w))
    return q, k, w, qp, kp, args


def _check_rows(idx, score, tol, vis, topk):
    for t in range(idx.shape[0]):
        v = vis[t]
        kp = min(topk, int(v.sum()))
        head = idx[t, :kp]
        assert np.all(idx[t, kp:] == -1)
        assert len(set(head.tolist())) == kp and np.all(v[head])
        if kp:
            rest = v.copy()
            rest[head] = False
            if rest.any():
                assert np.max(score[t, rest] - tol[t, rest]) <= np.min(score[t, head] + tol[t, head])


@needs_sm90
@pytest.mark.parametrize("h,s_q,s_kv,topk,docs", [(32, 300, 500, 64, False), (64, 200, 2100, 2048, False),
                                                  (20, 256, 256, 512, True)])
def test_gpu_matches_the_oracle_and_xla(h, s_q, s_kv, topk, docs):
    q, k, w, qp, kp, args = _gpu_inputs(h, s_q, s_kv)
    qs = ks = None
    vis = kp[None, :] <= qp[:, None]
    if docs:
        qs, ks = qp // 100, kp // 100
        vis &= ks[None, :] == qs[:, None]
    run = lambda impl: np.asarray(indexer_topk(*args, topk=topk, q_positions=qp, kv_positions=kp,
                                               q_segment_ids=qs, kv_segment_ids=ks,
                                               implementation=impl))
    got = run("cuda")
    assert got.shape == (s_q, topk) and got.dtype == np.int32
    np.testing.assert_array_equal(got, run("cuda"))  # deterministic
    score, tol = _oracle(q, k, w)
    _check_rows(got, score, tol, vis, topk)
    ref = run("xla")
    same = np.mean([set(a.tolist()) == set(b.tolist()) for a, b in zip(got, ref)])
    assert same > 0.9, same


@needs_sm90
def test_gpu_exact_ties_go_to_the_lower_index():
    rng = np.random.default_rng()
    s, h, topk = 700, 32, 96
    q = _bf(rng.standard_normal((s, h, 128)))
    k = np.abs(_bf(rng.standard_normal((s, 128))))
    k[rng.random(s) < 0.4] = 0  # exact zero scores
    k[1::3] = k[0:-1:3][: len(k[1::3])]  # duplicated keys: equal scores
    q[: s // 2] = -np.abs(q[: s // 2])  # these rows score every key exactly 0
    w = np.abs(rng.standard_normal((s, h))).astype(np.float32)
    pos = np.arange(s)
    args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(w))
    got = np.asarray(indexer_topk(*args, topk=topk, q_positions=pos, kv_positions=pos,
                                  implementation="cuda"))
    ref = np.asarray(indexer_topk(*args, topk=topk, q_positions=pos, kv_positions=pos,
                                  implementation="xla"))
    # All-zero rows: the lowest indices, in order, exactly as "xla".
    for t in range(s // 2):
        kp = min(topk, t + 1)
        np.testing.assert_array_equal(got[t, :kp], np.arange(kp))
    score, tol = _oracle(q, k, w)
    _check_rows(got, score, tol, pos[None, :] <= pos[:, None], topk)
    zeros_c = [[x for x in r if x >= 0 and score[t, x] == 0] for t, r in enumerate(got)]
    zeros_x = [[x for x in r if x >= 0 and score[t, x] == 0] for t, r in enumerate(ref)]
    assert zeros_c == zeros_x


@needs_sm90
@pytest.mark.parametrize("h,s_q,s_kv,topk", [(32, 300, 2100, 2048), (64, 200, 700, 64)])
def test_gpu_fp8_matches_the_fp8_oracle_and_xla(h, s_q, s_kv, topk):
    from test_indexer import np_quantize_fp8

    q, k, w, qp, kp, args = _gpu_inputs(h, s_q, s_kv)
    run = lambda impl: np.asarray(indexer_topk(*args, topk=topk, q_positions=qp, kv_positions=kp,
                                               qk_dtype="float8_e4m3fn", implementation=impl))
    got = run("cuda")
    np.testing.assert_array_equal(got, run("cuda"))  # deterministic
    q8, q_scale = np_quantize_fp8(q)
    k8, k_scale = np_quantize_fp8(k)
    score, tol = _oracle(q8, k8, w * q_scale)
    _check_rows(got, score * k_scale, tol * k_scale, kp[None, :] <= qp[:, None], topk)
    ref = run("xla")
    same = np.mean([set(a.tolist()) == set(b.tolist()) for a, b in zip(got, ref)])
    assert same > 0.97, same


@needs_module
def test_return_scores_lowers_to_a_scores_result():
    sds = jax.ShapeDtypeStruct
    b, s_q, s_kv, h, topk = 2, 70, 90, 32, 16
    args = (sds((b, s_q, h, 128), jnp.bfloat16), sds((b, s_kv, 128), jnp.bfloat16),
            sds((b, s_q, h), jnp.float32), sds((b, s_q), jnp.int32), sds((b, s_kv), jnp.int32))
    f = lambda q, k, w, qp, kp: indexer_topk(q, k, w, topk=topk, q_positions=qp, kv_positions=kp,
                                             return_scores=True, implementation="cuda")
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo.custom_call @(\w+)\(.*?\) \{.*?\} : \(.*?\) -> (.*)", text)
    ours = [r for name, r in calls if name == tc.TARGET]
    assert len(ours) == 1 and f"tensor<{b}x{s_q}x{topk}xf32>" in ours[0], ours


@needs_sm90
def test_gpu_return_scores_match_the_oracle():
    s_q, s_kv, h, topk = 300, 2100, 32, 2048
    q, k, w, qp, kp, args = _gpu_inputs(h, s_q, s_kv)
    idx, scores = indexer_topk(*args, topk=topk, q_positions=qp, kv_positions=kp,
                               return_scores=True, implementation="cuda")
    idx, scores = np.asarray(idx), np.asarray(scores)
    np.testing.assert_array_equal(idx, np.asarray(indexer_topk(
        *args, topk=topk, q_positions=qp, kv_positions=kp, implementation="cuda")))
    score, tol = _oracle(q, k, w)
    ok = idx >= 0
    assert np.all(scores[~ok] == -np.inf)
    rows = np.nonzero(ok)[0]
    assert np.all(np.abs(scores[ok] - score[rows, idx[ok]]) <= tol[rows, idx[ok]])
    with np.errstate(invalid="ignore"):  # -inf - -inf past the valid slots
        assert np.all(np.diff(scores, axis=1)[ok[:, 1:]] <= 0)  # descending (valid slots lead)


@needs_sm90
@pytest.mark.parametrize("h,s_q,s_kv,docs", [(32, 300, 500, False),    # CTAs split the keys
                                             (20, 200, 2100, True),    # padded heads, documents
                                             (64, 700, 700, True),
                                             (32, 2200, 2200, False)])  # one CTA a row block
def test_gpu_index_lse_matches_the_oracle(h, s_q, s_kv, docs):
    """The score kernel's log-sum-exp mode (the dense KL loss's normaliser) against float64,
    with a query that sees no key (-inf)."""
    q, k, w, qp, kp, args = _gpu_inputs(h, s_q, s_kv)
    qp = qp.copy()
    qp[3] = -1  # sees nothing
    qs = ks = None
    vis = kp[None, :] <= qp[:, None]
    if docs:
        qs, ks = qp // 100, kp // 100
        vis &= ks[None, :] == qs[:, None]
    i32 = lambda a: jnp.asarray(a, jnp.int32)[None]
    got = np.asarray(tc.index_lse_call(*(a[None] for a in args), i32(qp), i32(kp),
                                       None if qs is None else i32(qs),
                                       None if ks is None else i32(ks)))[0]
    score, tol = _oracle(q, k, w)
    has = vis.any(axis=1)
    assert got[3] == -np.inf and np.array_equal(np.isinf(got), ~has)
    masked = np.where(vis, score, -np.inf)[has]
    mx = np.max(masked, axis=1, keepdims=True)
    ref = np.log(np.sum(np.exp(masked - mx), axis=1)) + mx[:, 0]
    err = np.abs(got[has] - ref)
    bound = np.max(np.where(vis, tol, 0), axis=1)[has] + 1e-5 * np.abs(ref) + 1e-6
    assert np.all(err <= bound), float(np.max(err / bound))
