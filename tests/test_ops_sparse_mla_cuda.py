"""sparse_mla(implementation="cuda"): the SM90 forward kernel and the cuDNN DSA backward
(jax_dsa/ops/sparse_mla/cuda.py, the _cuda module).

On any machine with the CUDA module built: the backward glue's slot compaction against its
contract, the refusals, and the CUDA lowering of jax.grad (our forward and backward custom calls
with the kernels' operand shapes, no XLA gather of kv rows). The ``gpu`` tests (an SM90 GPU,
``make test-gpu``), on fresh random inputs against the float64 oracle (tests/oracle.py) or the
float64 "xla" implementation: the forward at GLM-5 (H 64, D_qk 576, K 2048) and DeepSeek V4
(D_qk 512, a sink) dims up to issue 7's full-size shapes, into NaN-poisoned output buffers,
twice (bit-identical); the backward at the same dims and past the last slot bucket (the wide
variant); the public op end to end; the glue's compaction. benchmarks/ops/sparse_mla_fwd.py and
benchmarks/ops/dsa_bwd.py time them.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import oracle
from jax_dsa import _native, sparse_mla
from jax_dsa.ops import sparse_mla as sparse_mla_module
from jax_dsa.ops.sparse_mla import cpu as sparse_mla_cpu
from jax_dsa.ops.sparse_mla import cuda as sparse_mla_cuda

needs_cuda = pytest.mark.skipif("cuda" not in _native.available(),
                                reason=f"CUDA module not built: {_native.LOAD_ERRORS.get('_cuda')}")


def _lower_cuda_grad(b, s_q, s_kv, h, d_qk, k, return_max_logits=False, deterministic=False):
    """StableHLO text of jax.grad of sparse_mla(implementation="cuda") lowered for CUDA, and
    its custom calls as (target, operands, attributes, operand types, result types). With
    ``return_max_logits`` the loss also sums max_logits (which takes no gradient)."""
    q = jax.ShapeDtypeStruct((b, s_q, h, d_qk), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s_kv, d_qk), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((b, s_q, k), jnp.int32)
    sink = jax.ShapeDtypeStruct((h,), jnp.float32)

    def loss(q, kv, sink, idx):
        res = sparse_mla(q, kv, idx, sm_scale=0.07, d_v=512, attn_sink=sink,
                         implementation="cuda", return_max_logits=return_max_logits,
                         deterministic=deterministic)
        extra = jnp.sum(jnp.where(jnp.isfinite(res[2]), res[2], 0)) if return_max_logits else 0
        return jnp.sum(res[0].astype(jnp.float32) ** 2) + extra

    text = (jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, sink, idx)
            .lower(lowering_platforms=("cuda",)).as_text())
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    return text, calls


@needs_cuda
@pytest.mark.parametrize("h,d_qk,k,bucket,hp", [(16, 576, 300, 512, 64), (64, 512, 640, 640, 64),
                                                (100, 512, 2048, 2048, 128),
                                                (64, 576, 3001, 3004, 64)])  # wide: K as is
def test_grad_lowers_to_the_cuda_backward_call(h, d_qk, k, bucket, hp):
    b, s_q, s_kv = 2, 70, 90
    text, calls = _lower_cuda_grad(b, s_q, s_kv, h, d_qk, k)
    ours = [c for c in calls if c[0] == sparse_mla_cuda.CUDA_BWD_TARGET]
    assert len(ours) == 1, set(c[0] for c in calls)
    _, _, attrs, operand_types, result_types = ours[0]
    t = b * s_q
    # Batch folded into tokens, heads padded to 64/128, slots padded to the bucket.
    assert f"tensor<{t}x{hp}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{b * s_kv}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{t}x{bucket}xi32>" in operand_types
    assert f"tensor<{t}xi32>" in operand_types
    ws = sparse_mla_cuda.cuda_workspace_bytes(t, b * s_kv, hp, d_qk)
    assert f"tensor<{ws}xui8>" in result_types
    assert "sm_scale" in attrs
    assert sparse_mla_cpu.CPU_BWD_TARGET not in text
    # the slot lists' stable partition is one kernel call, not a sort or a host-read branch
    assert sparse_mla_cuda.COMPACT_TARGET in {c[0] for c in calls}
    assert "stablehlo.sort" not in text and "stablehlo.case" not in text


@needs_cuda
@pytest.mark.parametrize("h,d_qk,k,hp", [(16, 576, 300, 64), (100, 512, 2048, 128)])
def test_deterministic_grad_lowers_to_the_own_backward(h, d_qk, k, hp):
    """deterministic=True: jax_dsa's own backward kernel (attribute deterministic) in place of
    cuDNN's, on the same glue, with the workspace its launch code asks for."""
    b, s_q, s_kv = 2, 70, 90
    text, calls = _lower_cuda_grad(b, s_q, s_kv, h, d_qk, k, deterministic=True)
    targets = {c[0] for c in calls}
    assert sparse_mla_cuda.CUDA_BWD_TARGET not in targets
    (own,) = [c for c in calls if c[0] == sparse_mla_cuda.OWN_BWD_TARGET]
    _, _, attrs, operand_types, result_types = own
    t, bucket = b * s_q, sparse_mla_cuda.slot_bucket(k)
    assert f"tensor<{t}x{hp}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{t}x{bucket}xi32>" in operand_types
    ws = sparse_mla_cuda.own_backward_workspace_bytes(t, b * s_kv, hp, d_qk, bucket, True)
    assert f"tensor<{ws}xui8>" in result_types
    assert "deterministic = true" in attrs


@needs_cuda
def test_env_picks_the_own_backward(monkeypatch):
    """JAX_DSA_SPARSE_MLA_BWD=jax_dsa: the own kernel in its atomic mode, on the same glue."""
    monkeypatch.setenv(sparse_mla_cuda.BWD_KERNEL_ENV, "jax_dsa")
    b, s_q, s_kv, h, d_qk, k = 2, 70, 90, 16, 576, 300
    _, calls = _lower_cuda_grad(b, s_q, s_kv, h, d_qk, k)
    (own,) = [c for c in calls if c[0] == sparse_mla_cuda.OWN_BWD_TARGET]
    assert sparse_mla_cuda.CUDA_BWD_TARGET not in {c[0] for c in calls}
    _, _, attrs, _, result_types = own
    ws = sparse_mla_cuda.own_backward_workspace_bytes(b * s_q, b * s_kv, 64, d_qk,
                                                      sparse_mla_cuda.slot_bucket(k), False)
    assert f"tensor<{ws}xui8>" in result_types
    assert "deterministic = false" in attrs


@pytest.mark.parametrize("value,det,want", [(None, False, "cudnn"), ("", False, "cudnn"),
                                            ("auto", False, "cudnn"), ("cudnn", False, "cudnn"),
                                            ("jax_dsa", False, "jax_dsa"),
                                            (None, True, "jax_dsa"), ("auto", True, "jax_dsa"),
                                            ("jax_dsa", True, "jax_dsa")])
def test_backward_kernel_choice(value, det, want, monkeypatch):
    if value is None:
        monkeypatch.delenv(sparse_mla_cuda.BWD_KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(sparse_mla_cuda.BWD_KERNEL_ENV, value)
    assert sparse_mla_cuda.backward_kernel(det) == want
    # "auto" takes jax_dsa's backward from OWN_BWD_MIN_S_KV keys on; an explicit choice stays.
    long = sparse_mla_cuda.OWN_BWD_MIN_S_KV
    assert sparse_mla_cuda.backward_kernel(det, long - 1) == want
    auto = value in (None, "", "auto")
    assert sparse_mla_cuda.backward_kernel(det, long) == ("jax_dsa" if auto else want)


@pytest.mark.parametrize("value,det,match", [("flash", False, "expected one of"),
                                             ("cudnn", True, "not deterministic")])
def test_backward_kernel_choice_rejects(value, det, match, monkeypatch):
    monkeypatch.setenv(sparse_mla_cuda.BWD_KERNEL_ENV, value)
    with pytest.raises(ValueError, match=f"JAX_DSA_SPARSE_MLA_BWD.*{match}"):
        sparse_mla_cuda.backward_kernel(det)


@needs_cuda
@pytest.mark.parametrize("s_q,s_kv,h,d,k", [(1, 1, 64, 512, 1), (70, 90, 128, 576, 2048),
                                            (16384, 16384, 64, 576, 2048),
                                            (131072, 131072, 128, 512, 2048)])
def test_own_backward_workspace_matches_the_launch_code(s_q, s_kv, h, d, k):
    """The glue's workspace formula is the kernel's own (SparseMlaBwdWorkspaceBytes)."""
    from jax_dsa import _cuda
    for det in (False, True):
        assert (sparse_mla_cuda.own_backward_workspace_bytes(s_q, s_kv, h, d, k, det)
                == _cuda.sparse_mla_bwd_workspace_bytes(s_q, s_kv, h, d, k, det))


def _glue_oracle(idx, length, s_kv, k_out, sort_rows=False):
    """The backward glue's contract in numpy: each row's valid slots (in range, before
    topk_length) as global rows first, in order (ascending with ``sort_rows``), -1 after; an
    empty row gets row 0 of its batch element."""
    nb, s_q, k = idx.shape
    want = np.full((nb, s_q, k_out), -1, np.int32)
    count = np.zeros((nb, s_q), np.int32)
    for b in range(nb):
        for t in range(s_q):
            valid = [int(j) + b * s_kv for pos, j in enumerate(idx[b, t])
                     if 0 <= j < s_kv and pos < length[b, t]]
            count[b, t] = len(valid)
            want[b, t, :len(valid)] = sorted(valid) if sort_rows else valid
            if not valid:
                want[b, t, 0] = b * s_kv
    return want, np.maximum(count, 1), count == 0


def _glue_case(seed, nb=2, s_q=9, s_kv=7, k=5):
    rng = np.random.default_rng(seed)
    idx = rng.integers(-3, s_kv + 3, (nb, s_q, k)).astype(np.int32)
    idx[-1, min(2, s_q - 1)] = -1
    length = rng.integers(0, k + 1, (nb, s_q)).astype(np.int32)
    return idx, length, s_kv


def test_slot_rows_mask_in_place_and_count():
    """The glue's elementwise part (pure JAX, on the host): global rows of the valid slots where
    they stand, -1 elsewhere, the safe slot of an empty row; its stable partition is the
    contract."""
    idx, length, s_kv = _glue_case(0)
    rows, g_len, empty = map(np.asarray, sparse_mla_cuda.cuda_slot_rows(
        jnp.asarray(idx), jnp.asarray(length), s_kv))
    nb, s_q, k = idx.shape
    want, want_len, want_empty = _glue_oracle(idx, length, s_kv, k)
    np.testing.assert_array_equal(g_len, want_len)
    np.testing.assert_array_equal(empty, want_empty)
    valid = (idx >= 0) & (idx < s_kv) & (np.arange(k) < length[..., None])
    offset = (np.arange(nb) * s_kv)[:, None, None]
    in_place = np.where(valid, idx + offset, -1)
    in_place[..., 0] = np.where(want_empty, offset[..., 0], in_place[..., 0])
    np.testing.assert_array_equal(rows, in_place)
    part = np.stack([np.concatenate([r[r >= 0], r[r < 0]]) for r in rows.reshape(-1, k)])
    np.testing.assert_array_equal(part.reshape(want.shape), want)


def test_glue_compacts_in_one_custom_call_without_sort_or_branch():
    """The stable partition is the _cuda module's compaction kernel: no XLA sort, no conditional
    (whose predicate XLA reads on the host), the bucket's padding in the same call."""
    idx, length, s_kv = _glue_case(1)
    nb, s_q, k = idx.shape
    text = jax.jit(sparse_mla_cuda.cuda_index_glue, static_argnums=(2, 3)).trace(
        jnp.asarray(idx), jnp.asarray(length), s_kv, 8).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) .*: \((.*?)\) -> (.*)", text)
    assert [c[0] for c in calls] == [sparse_mla_cuda.COMPACT_TARGET]
    assert f"tensor<{nb * s_q}x{k}xi32>" in calls[0][2] and f"tensor<{nb * s_q}x8xi32>" in calls[0][3]
    assert "stablehlo.sort" not in text and "stablehlo.case" not in text
    with pytest.raises(ValueError, match="k_out=4 must be >= K=5"):
        sparse_mla_cuda.compact_slots(jnp.asarray(idx.reshape(-1, k)), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("sort_rows", [False, True])
@pytest.mark.parametrize("seed,nb,s_q,s_kv,k,k_out", [
    (2, 2, 9, 7, 5, 5), (3, 2, 9, 7, 5, 12),        # bucket padding
    (4, 1, 300, 5000, 2048, 2048),                  # one tile of the kernel exactly
    (5, 2, 40, 900, 4500, 4608),                    # several tiles a row; the 4096-slot sort
    (6, 1, 20, 70000, 8320, 8320)])                 # past the longest sorted list: in order
def test_glue_on_the_gpu_matches_the_contract(seed, nb, s_q, s_kv, k, k_out, sort_rows):
    idx, length, s_kv = _glue_case(seed, nb, s_q, s_kv, k)
    idx[0, 0] = -1  # an empty row
    length[-1, -1] = k
    idx[-1, -1] = np.arange(k) % s_kv  # a full row
    g_idx, g_len, empty = map(np.asarray, jax.jit(
        sparse_mla_cuda.cuda_index_glue, static_argnums=(2, 3, 4))(
            jnp.asarray(idx), jnp.asarray(length), s_kv, k_out, sort_rows))
    want, want_len, want_empty = _glue_oracle(idx, length, s_kv, k_out,
                                              sort_rows and k <= sparse_mla_cuda.MAX_SORTED_SLOTS)
    np.testing.assert_array_equal(g_idx, want)
    np.testing.assert_array_equal(g_len, want_len)
    np.testing.assert_array_equal(empty, want_empty)


def test_unsupported_calls_are_refused_with_the_rule():
    q = np.zeros((4, 2, 576), np.float32)
    kv = np.zeros((6, 576), np.float32)
    idx = np.zeros((4, 3), np.int32)
    cases = [
        (dict(q=q.astype(jnp.bfloat16), kv=kv.astype(jnp.bfloat16), d_v=256), "d_v=512"),
        (dict(q=np.zeros((4, 130, 576), jnp.bfloat16), kv=kv.astype(jnp.bfloat16)), "heads"),
    ]
    for change, match in cases:
        a = dict(q=q, kv=kv, idx=idx, d_v=512)
        a.update(change)
        if "cuda" not in sparse_mla_module.AVAILABLE:
            match = "not available"
        with pytest.raises((ValueError, NotImplementedError), match=match):
            jax.eval_shape(lambda q, kv, i: sparse_mla(q, kv, i, sm_scale=0.1, d_v=a["d_v"],
                                                       implementation="cuda"),
                           a["q"], a["kv"], a["idx"])


@needs_cuda
@pytest.mark.parametrize("return_max_logits", [False, True])
@pytest.mark.parametrize("h,d_qk,k,hp", [(16, 576, 300, 64), (100, 512, 640, 128),
                                         (64, 576, 30, 64)])
def test_cuda_lowers_to_own_forward_and_backward_without_kv_gather(h, d_qk, k, hp,
                                                                   return_max_logits):
    b, s_q, s_kv = 2, 70, 90
    text, calls = _lower_cuda_grad(b, s_q, s_kv, h, d_qk, k, return_max_logits)
    fwd = [c for c in calls if c[0] == sparse_mla_cuda.CUDA_FWD_TARGET]
    assert len(fwd) == 1, set(c[0] for c in calls)
    assert sum(c[0] == sparse_mla_cuda.CUDA_BWD_TARGET for c in calls) == 1
    _, _, attrs, operand_types, result_types = fwd[0]
    t = b * s_q
    # Batch folded into tokens, heads padded to 64/128, slots padded to a multiple of 4.
    assert f"tensor<{t}x{hp}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{b * s_kv}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{t}x{-(-k // 4) * 4}xi32>" in operand_types
    # Three results, max_logits computed by the kernel itself (asked for or not).
    assert re.findall(r"tensor<[^>]*>", result_types) == [
        f"tensor<{t}x{hp}x512xbf16>", f"tensor<{t}x{hp}xf32>", f"tensor<{t}x{hp}xf32>"]
    # No XLA gather of kv rows: the only gathers are of int32 slot ids (the backward's glue).
    for line in text.splitlines():
        if "stablehlo.gather" in line:
            assert "bf16" not in line and "f32" not in line, line


@needs_cuda
def test_cuda_max_logits_is_the_forward_calls_third_result():
    """return_max_logits: the third output comes from the kernel (the custom call's result #2,
    un-padded to H heads), not from an XLA recomputation over gathered rows."""
    b, s_q, s_kv, h, d_qk, k = 2, 70, 90, 16, 576, 300
    q = jax.ShapeDtypeStruct((b, s_q, h, d_qk), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s_kv, d_qk), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((b, s_q, k), jnp.int32)
    f = lambda q, kv, idx: sparse_mla(q, kv, idx, sm_scale=0.07, d_v=512, implementation="cuda",
                                      return_max_logits=True)
    shapes = jax.eval_shape(f, q, kv, idx)
    assert [(x.shape, x.dtype) for x in shapes] == [
        ((b, s_q, h, 512), jnp.bfloat16), ((b, s_q, h), jnp.float32), ((b, s_q, h), jnp.float32)]
    text = jax.jit(f).trace(q, kv, idx).lower(lowering_platforms=("cuda",)).as_text()
    fwd = re.findall(rf"(%\w+):3 = stablehlo.custom_call @{sparse_mla_cuda.CUDA_FWD_TARGET}\(", text)
    assert len(fwd) == 1, text
    assert f"{fwd[0]}#2 " in text  # max_logits read from the kernel's third result
    assert "stablehlo.gather" not in text and "stablehlo.reduce" not in text


def test_cuda_on_the_host_fails_with_a_clear_error():
    if "cuda" not in _native.available() or jax.default_backend() != "cpu":
        pytest.skip("needs the CUDA module built and a host-only run")
    q = jnp.zeros((4, 4, 576), jnp.bfloat16)
    kv = jnp.zeros((8, 576), jnp.bfloat16)
    with pytest.raises(Exception, match="needs an SM90 GPU"):
        sparse_mla(q, kv, jnp.zeros((4, 8), jnp.int32), sm_scale=0.1,
                   implementation="cuda")[0].block_until_ready()


# ---------------------------------------------------------------------------------------------
# On an SM90 GPU: the forward kernel through its FFI handler (flat tokens, H 64 or 128, K a
# multiple of 4: the kernel's own contract, raw out-of-range slot ids included), against the
# float64 oracle (what was the accuracy list of the forward's benchmark,
# benchmarks/ops/sparse_mla_fwd.py)

D_V = 512
FULL_SIZE = {  # issue 7's shapes: (a) S_kv 32768 H 128, (b) GLM-5 training, (c) V4 with a sink
    "a": dict(s_q=4096, s_kv=32768, h=128, d=576, k=2048, sink="-inf"),
    "b": dict(s_q=16384, s_kv=16384, h=64, d=576, k=2048, sink="-inf"),
    "c": dict(s_q=16384, s_kv=16384, h=64, d=512, k=640, sink="finite"),
}
FWD_CASES = [
    ("H64 D576 K128 sink lengths",
     dict(s_q=67, s_kv=500, h=64, d=576, k=128, empty_rows=(5,), lengths=True)),
    ("H128 D576 K2048 S_kv<K no sink",
     dict(s_q=33, s_kv=1000, h=128, d=576, k=2048, empty_rows=(6,), sink="-inf")),
    ("H64 D512 K640 sink lengths",
     dict(s_q=70, s_kv=3000, h=64, d=512, k=640, empty_rows=(5, 9), lengths=True)),
    ("H128 D512 K256 mixed sinks",
     dict(s_q=65, s_kv=200, h=128, d=512, k=256, empty_rows=(7,), sink="mixed")),
    ("H64 D576 K2048 all valid S_kv 70000",
     dict(s_q=20, s_kv=70000, h=64, d=576, k=2048, all_valid=True, sink="-inf")),
    ("H128 D576 K192 S_kv 32 lengths",
     dict(s_q=129, s_kv=32, h=128, d=576, k=192, lengths=True)),
    ("H64 D576 K1024 lengths 600 rows",
     dict(s_q=600, s_kv=5000, h=64, d=576, k=1024, empty_rows=(9,), lengths=True)),
    # full size (every CTA walks many tiles); the reference on ~80 rows
    *((f"({n}) full size, rows sampled",
       dict(kw, empty_rows=(11, kw["s_q"] // 2, kw["s_q"] - 1), lengths=True, sample=48))
      for n, kw in FULL_SIZE.items()),
]


def _fwd_case(key, s_q, s_kv, h, d, k, *, invalid=0.15, empty_rows=(), dup=True, lengths=False,
              sink="finite", all_valid=False):
    """Random inputs on the device: bf16 q (x 0.5) and kv; slot ids with -1, ids past S_kv and
    at int32's ends, empty rows, duplicates within a row and across rows; random topk_length
    (row 0 full, row 4 zero) or K; a finite, -inf or mixed (finite, -inf, +inf) sink."""
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (s_q, h, d), bf) * bf(0.5)
    kv = jax.random.normal(ks[1], (s_kv, d), bf)
    idx = jax.random.randint(ks[2], (s_q, k), 0, s_kv, jnp.int32)
    if not all_valid:
        u = jax.random.uniform(ks[3], (s_q, k))
        far = jnp.array([s_kv, s_kv + 7, 2**31 - 1, -(2**31)], jnp.int32)
        pick = far[jax.random.randint(ks[4], (s_q, k), 0, 4)]
        idx = jnp.where(u < invalid, -1, jnp.where(u < invalid + 0.03, pick, idx))
        for r in empty_rows:
            if r < s_q:
                idx = idx.at[r].set(-1)
        if dup and s_q > 3:
            idx = idx.at[2].set(idx[3])  # identical rows
            idx = idx.at[1, :k // 2].set(idx[1, 0])  # one kv row many times in one query
    if lengths:
        length = jax.random.randint(ks[5], (s_q,), 0, k + 1, jnp.int32).at[0].set(k)
        if s_q > 4:
            length = length.at[4].set(0)
    else:
        length = jnp.full((s_q,), k, jnp.int32)
    att = jax.random.normal(ks[6], (h,), jnp.float32) * 1.5
    if sink == "-inf":
        att = jnp.full((h,), -jnp.inf, jnp.float32)
    elif sink == "mixed":
        att = att.at[::3].set(-jnp.inf).at[1].set(jnp.inf)
    return q, kv, idx, length, att


def _poison(*shapes_dtypes):
    """Best effort: free blocks of the outputs' sizes filled with NaN, which XLA's allocator
    hands to the next call's outputs; an element the kernel does not write stays NaN."""
    bufs = [jnp.full(s, jnp.nan, dt) for s, dt in shapes_dtypes]
    jax.block_until_ready(bufs)
    del bufs


@pytest.mark.gpu
@pytest.mark.parametrize("name,case", FWD_CASES, ids=[c[0] for c in FWD_CASES])
def test_gpu_forward_kernel_matches_float64(name, case):
    """Launched twice into NaN-poisoned outputs: every output written, the launches
    bit-identical; out (relative L2 <= 3e-3), lse and max_logits (<= 1e-4 absolute) against the
    float64 oracle on every row or on the first, middle and last 12 rows and 48 random ones;
    rows without a valid slot: out 0, lse +inf, max_logits -inf."""
    case = dict(case)
    sample = case.pop("sample", 0)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    q, kv, idx, length, sink = _fwd_case(jax.random.key(seed), **case)
    s_q, h, d = q.shape
    sm_scale = 1.3 / math.sqrt(d)
    sds = jax.ShapeDtypeStruct
    shapes = (((s_q, h, D_V), jnp.bfloat16), ((s_q, h), jnp.float32), ((s_q, h), jnp.float32))
    call = jax.ffi.ffi_call(sparse_mla_cuda.CUDA_FWD_TARGET, tuple(sds(*s) for s in shapes))
    fwd = jax.jit(lambda *a: call(*a, sm_scale=np.float32(sm_scale)))
    runs = []
    for _ in range(2):
        _poison(*shapes)
        runs.append(jax.block_until_ready(fwd(q, kv, idx, length, sink)))
    (out, lse, mx), again = runs
    for name_, a, b in zip(("out", "lse", "max_logits"), (out, lse, mx), again):
        assert not bool(jnp.any(jnp.isnan(a))), f"{name} (seed {seed}): {name_} not all written"
        bits = jnp.int16 if a.dtype == jnp.bfloat16 else jnp.int32
        assert bool(jnp.all(jax.lax.bitcast_convert_type(a, bits)
                            == jax.lax.bitcast_convert_type(b, bits))), (name, seed, name_)
    rows = np.arange(s_q)
    if sample:
        # the first rows hold the duplicates and the zero topk_length and land in the CTAs'
        # first tiles, the last ones in their last tiles (the output stored after the loop)
        ends = np.arange(12)
        rng = np.random.default_rng(seed)
        rows = np.unique(np.concatenate([ends, s_q // 2 - 6 + ends, s_q - 12 + ends,
                                         rng.permutation(s_q)[:sample]]))
    at = jnp.asarray(rows)
    f64 = lambda a: np.asarray(a[at], np.float64)
    ro, rl, _, _, _, rm = oracle.sparse_mla(
        f64(q), np.asarray(kv, np.float64), np.asarray(idx[at]), sm_scale, D_V,
        np.asarray(sink, np.float64), np.asarray(length[at]))
    o, l, m = f64(out), f64(lse), f64(mx)
    fin = np.isfinite(rl)
    empty = ~fin
    info = f"{name} (seed {seed})"
    assert np.array_equal(np.isfinite(l), fin), info
    assert np.all(np.isposinf(l[empty])) and np.all(np.isneginf(m[empty])), info
    assert np.all(o[empty] == 0), info
    assert oracle.rel_l2(o, ro) <= 3e-3, info
    if fin.any():
        assert np.abs(l[fin] - rl[fin]).max() <= 1e-4, info
        assert np.abs(m[fin] - rm[fin]).max() <= 1e-4, info


@pytest.mark.gpu
def test_gpu_end_to_end_matches_float64():
    """sparse_mla(implementation="cuda") (own forward, cuDNN backward, the glue: head padding,
    batch folding, -1 and out-of-range slots, an empty row, topk_length, a sink, K not a multiple
    of 4): out, lse and jax.grad against float64 "xla" on the same bf16 inputs (relative L2
    <= 1e-2, the same non-finite entries), and the program holds both custom calls."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    b, s_q, s_kv, h, d, k = 2, 50, 400, 16, 576, 301
    q = jnp.asarray(rng.standard_normal((b, s_q, h, d)) * 0.5, jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, s_kv, d)), jnp.bfloat16)
    idx = rng.integers(0, s_kv, (b, s_q, k)).astype(np.int32)
    u = rng.random(idx.shape)
    idx = np.where(u < 0.15, -1, np.where(u < 0.18, s_kv + 3, idx)).astype(np.int32)
    idx[:, 5] = -1
    idx, length = jnp.asarray(idx), jnp.asarray(rng.integers(0, k + 1, (b, s_q)), jnp.int32)
    sink = jnp.asarray(rng.standard_normal(h) * 1.5, jnp.float32)
    w = rng.standard_normal((b, s_q, h, 512))

    def value_and_grads(impl, w):
        def loss(q, kv, sink):
            out, lse = sparse_mla(q, kv, idx, sm_scale=0.06, d_v=512, attn_sink=sink,
                                  topk_length=length, implementation=impl)
            return jnp.sum(out.astype(w.dtype) * w), (out, lse)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    f = value_and_grads("cuda", jnp.asarray(w, jnp.float32))
    (_, (out, lse)), grads = f(q, kv, sink)
    got = [np.asarray(x, np.float64) for x in (out, lse) + tuple(grads)]
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(x, jnp.float64)
        (_, (out, lse)), grads = value_and_grads("xla", f64(w))(f64(q), f64(kv), f64(sink))
        want = [np.asarray(x, np.float64) for x in (out, lse) + tuple(grads)]
    for name, a, ref in zip(("out", "lse", "dq", "dkv", "d_attn_sink"), got, want):
        fin = np.isfinite(ref)
        assert np.array_equal(np.isfinite(a), fin), (name, seed)
        assert oracle.rel_l2(a[fin], ref[fin]) <= 1e-2, (name, seed)
    text = f.lower(q, kv, sink).as_text()
    calls = set(re.findall(r"stablehlo.custom_call @(\w+)", text))
    assert {sparse_mla_cuda.CUDA_FWD_TARGET, sparse_mla_cuda.CUDA_BWD_TARGET} <= calls, calls


# ---------------------------------------------------------------------------------------------
# On an SM90 GPU: dq, dkv, d_attn_sink of the cuDNN backward through the public op against the
# same gradients in float64 from "xla" (what was the accuracy part of the backward's benchmark,
# benchmarks/ops/dsa_bwd.py)

BWD_CASES = [  # (name, batch, s_q, s_kv, h, d, k, sink, lengths, sm_scale, valid_first)
    ("glm5 H64 D576 K2048 S_q200 S_kv3000", (), 200, 3000, 64, 576, 2048, False, False, 1 / 16,
     False),
    ("glm5 H64 D576 K2048, valid-first lists (the layers' case)", (), 200, 3000, 64, 576, 2048,
     False, False, 1 / 16, True),
    ("v4 H64 D512 K512 sink S_q77 S_kv1000 topk_length", (), 77, 1000, 64, 512, 512, True, True,
     512**-0.5, False),
    ("v4 H64 D512 K640 sink S_q200 S_kv1500", (), 200, 1500, 64, 512, 640, True, False,
     512**-0.5, False),
    ("glue B2 H24 D576 K300 sink S_q70 S_kv400 topk_length", (2,), 70, 400, 24, 576, 300, True,
     True, 0.07, False),
    # past the last slot bucket: the wide variant (K a run-time size)
    ("wide H64 D576 K4096 S_q100 S_kv6000 topk_length", (), 100, 6000, 64, 576, 4096, False, True,
     1 / 16, False),
    ("wide H64 D512 K8320 sink S_q64 S_kv9000", (), 64, 9000, 64, 512, 8320, True, False,
     512**-0.5, False),
    ("v3.2 H128 D576 K640 sink S_q100 S_kv1500 topk_length", (), 100, 1500, 128, 576, 640, True,
     True, 192**-0.5, False),
]


def _bwd_case(rng, batch, s_q, s_kv, h, d, k, sink, lengths, valid_first):
    """bf16 q (x 0.5), kv and dout; -1 and out-of-range slots, an empty row (5), duplicates
    across queries (rows 6, 7), or valid-first lists (a valid prefix of random length, -1
    after); a sink; topk_length."""
    q = (rng.standard_normal(batch + (s_q, h, d)) * 0.5).astype(np.float32)
    kv = rng.standard_normal(batch + (s_kv, d)).astype(np.float32)
    idx = rng.integers(0, s_kv, batch + (s_q, k)).astype(np.int32)
    if valid_first:
        count = rng.integers(0, k + 1, batch + (s_q, 1))
        idx = np.where(np.arange(k) < count, idx, -1).astype(np.int32)
    else:
        u = rng.random(idx.shape)
        idx = np.where(u < 0.15, -1, idx)
        idx = np.where((u >= 0.15) & (u < 0.18), s_kv + rng.integers(0, 50, idx.shape), idx)
        idx[..., 6, :] = idx[..., 7, :]  # identical rows: duplicates across queries
    idx[..., 5, :] = -1  # an empty row
    att = rng.standard_normal(h) * 1.5 if sink else np.full(h, -np.inf)
    ln = rng.integers(0, k + 1, batch + (s_q,)).astype(np.int32) if lengths else None
    dout = rng.standard_normal(batch + (s_q, h, 512)).astype(np.float32)
    bf = jnp.bfloat16
    return dict(q=jnp.asarray(q, bf), kv=jnp.asarray(kv, bf), idx=jnp.asarray(idx),
                sink=jnp.asarray(att, jnp.float32), length=None if ln is None else jnp.asarray(ln),
                dout=jnp.asarray(dout, bf))


def _grads(c, impl, sm_scale, dtype=None, deterministic=False):
    q, kv, dout, sink = c["q"], c["kv"], c["dout"], c["sink"]
    if dtype is not None:
        q, kv, dout, sink = (x.astype(dtype) for x in (q, kv, dout, sink))

    def f(q, kv, sink):
        return sparse_mla(q, kv, c["idx"], sm_scale=sm_scale, d_v=512, attn_sink=sink,
                          topk_length=c["length"], implementation=impl,
                          deterministic=deterministic)

    (_, lse), vjp = jax.vjp(f, q, kv, sink)
    return [np.asarray(x, np.float64) for x in vjp((dout, jnp.zeros_like(lse)))]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,deterministic", [("cudnn", False), ("jax_dsa", False),
                                                  ("auto", True)],
                         ids=["cudnn", "jax_dsa", "deterministic"])
@pytest.mark.parametrize("case", BWD_CASES, ids=[c[0] for c in BWD_CASES])
def test_gpu_backward_matches_float64(case, kernel, deterministic, monkeypatch):
    """Every gradient finite and within relative L2 1e-2 of float64 (without a sink its
    gradient at most 1e-2 in absolute value), and zero dq on the empty row, with each backward
    kernel. Deterministic (the own kernel): a second run bitwise identical."""
    monkeypatch.setenv(sparse_mla_cuda.BWD_KERNEL_ENV, kernel)
    name, batch, s_q, s_kv, h, d, k, sink, lengths, sm_scale, valid_first = case
    seed = int(np.random.SeedSequence().entropy % 2**32)
    c = _bwd_case(np.random.default_rng(seed), batch, s_q, s_kv, h, d, k, sink, lengths,
                  valid_first)
    got = _grads(c, "cuda", sm_scale, deterministic=deterministic)
    if deterministic:
        again = _grads(c, "cuda", sm_scale, deterministic=True)
        for g_name, a, b in zip(("dq", "dkv", "d_attn_sink"), got, again):
            np.testing.assert_array_equal(a, b, err_msg=g_name)
    with jax.enable_x64(True):
        want = _grads(c, "xla", sm_scale, jnp.float64)
    info = f"{name} (seed {seed})"
    for g_name, g in zip(("dq", "dkv", "d_attn_sink"), got):
        assert np.all(np.isfinite(g)), (info, g_name)
    assert oracle.rel_l2(got[0], want[0]) <= 1e-2, (info, "dq")
    assert oracle.rel_l2(got[1], want[1]) <= 1e-2, (info, "dkv")
    if sink:
        assert oracle.rel_l2(got[2], want[2]) <= 1e-2, (info, "d_attn_sink")
    else:
        assert np.max(np.abs(got[2])) <= 1e-2, (info, "d_attn_sink")
    assert np.all(got[0][..., 5, :, :] == 0), (info, "dq of the empty row")
