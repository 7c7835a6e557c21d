"""The CUDA module on a machine without a GPU: it loads (or says why not), and the backward of
implementation="cuda" lowers to the project's own FFI custom call with the kernel's contract.

The numerics run on an SM90 GPU: benchmarks/gpu_dsa_bwd.py (results in benchmarks/results/).
"""

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsa import _native, sparse_mla
from jax_dsa.ops import sparse_mla as sparse_mla_module
from jax_dsa.ops import sparse_mla_ffi

# CI builds with nvcc on PATH, so there the module must be present (JAX_DSA_CUDA=OFF opts out).
EXPECT_CUDA = shutil.which("nvcc") is not None and os.environ.get("JAX_DSA_CUDA", "AUTO") != "OFF"


def test_cuda_module_loads_or_reports_why():
    if "cuda" in _native.available():
        mod = _native.require("_cuda")
        assert tuple(mod.FFI_API_VERSION) == (0, 4)
        variants = set(map(tuple, mod.variants()))
        want = {(h, d, k) for h in sparse_mla_ffi.KERNEL_HEADS for d in sparse_mla_ffi.KERNEL_D_QK
                for k in sparse_mla_ffi.SLOT_BUCKETS}
        assert variants == want  # the glue's buckets are exactly the compiled ones
        # The handler's workspace formula and the glue's agree (frontend 1.32 SM90 formula).
        for s_q, s_kv, h, d in [(200, 1000, 64, 576), (77, 3000, 128, 512), (1, 1, 64, 512)]:
            assert mod.workspace_bytes(s_q, s_kv, h, d) == sparse_mla_ffi.cuda_workspace_bytes(
                s_q, s_kv, h, d)
        assert mod.workspace_bytes(200, 1000, 64, 576) == 2 * 65536 + 1024 * 576 * 4
    else:
        reason = _native.LOAD_ERRORS.get("_cuda", "")
        assert "_cuda" in reason or "cuda" in reason.lower(), reason
        with pytest.raises(NotImplementedError, match="_cuda"):
            _native.require("_cuda")
        assert not EXPECT_CUDA, f"nvcc is on PATH but the CUDA module did not load: {reason}"


needs_cuda = pytest.mark.skipif("cuda" not in _native.available(),
                                reason=f"CUDA module not built: {_native.LOAD_ERRORS.get('_cuda')}")


@needs_cuda
@pytest.mark.parametrize("h,d_qk,k,bucket,hp", [(16, 576, 300, 512, 64), (64, 512, 640, 640, 64),
                                                (100, 512, 2048, 2048, 128)])
def test_grad_lowers_to_the_cuda_backward_call(h, d_qk, k, bucket, hp):
    b, s_q, s_kv = 2, 70, 90
    q = jax.ShapeDtypeStruct((b, s_q, h, d_qk), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s_kv, d_qk), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((b, s_q, k), jnp.int32)
    sink = jax.ShapeDtypeStruct((h,), jnp.float32)

    def loss(q, kv, sink, idx):
        out, _ = sparse_mla(q, kv, idx, sm_scale=0.07, d_v=512, attn_sink=sink,
                            implementation="cuda")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    text = (jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, sink, idx)
            .lower(lowering_platforms=("cuda",)).as_text())
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    ours = [c for c in calls if c[0] == sparse_mla_ffi.CUDA_BWD_TARGET]
    assert len(ours) == 1, set(c[0] for c in calls)
    _, _, attrs, operand_types, result_types = ours[0]
    t = b * s_q
    # Batch folded into tokens, heads padded to 64/128, slots padded to the bucket.
    assert f"tensor<{t}x{hp}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{b * s_kv}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{t}x{bucket}xi32>" in operand_types
    assert f"tensor<{t}xi32>" in operand_types
    ws = sparse_mla_ffi.cuda_workspace_bytes(t, b * s_kv, hp, d_qk)
    assert f"tensor<{ws}xui8>" in result_types
    assert "sm_scale" in attrs
    assert sparse_mla_ffi.CPU_BWD_TARGET not in text


def test_glue_normalises_indices_to_a_valid_prefix():
    """The index glue alone (pure JAX): valid slots first, in order, -1 after, global rows."""
    rng = np.random.default_rng(0)
    nb, s_q, s_kv, k = 2, 9, 7, 5
    idx = rng.integers(-3, 10, (nb, s_q, k)).astype(np.int32)
    idx[1, 2] = -1
    length = rng.integers(0, k + 1, (nb, s_q)).astype(np.int32)
    g_idx, g_len, empty = sparse_mla_ffi.cuda_index_glue(jnp.asarray(idx), jnp.asarray(length), s_kv)
    g_idx, g_len, empty = map(np.asarray, (g_idx, g_len, empty))
    assert g_idx.shape == (nb, s_q, k)
    for b in range(nb):
        for t in range(s_q):
            valid = [int(j) + b * s_kv for pos, j in enumerate(idx[b, t])
                     if 0 <= j < s_kv and pos < length[b, t]]
            if valid:
                assert not empty[b, t] and g_len[b, t] == len(valid)
                np.testing.assert_array_equal(g_idx[b, t, :len(valid)], valid)
                assert np.all(g_idx[b, t, len(valid):] == -1)
            else:  # one safe slot (row 0 of this batch element), masked by lse=+inf, dout=0
                assert empty[b, t] and g_len[b, t] == 1 and g_idx[b, t, 0] == b * s_kv


def test_unsupported_calls_are_refused_with_the_rule():
    q = np.zeros((4, 2, 576), np.float32)
    kv = np.zeros((6, 576), np.float32)
    idx = np.zeros((4, 3), np.int32)
    cases = [
        (dict(q=q.astype(jnp.bfloat16), kv=kv.astype(jnp.bfloat16), d_v=256), "d_v=512"),
        (dict(idx=np.zeros((4, 4096), np.int32), q=q.astype(jnp.bfloat16),
              kv=kv.astype(jnp.bfloat16)), "2048"),
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
@pytest.mark.parametrize("h,d_qk,k,hp", [(16, 576, 300, 64), (100, 512, 640, 128)])
def test_cuda_lowers_to_own_forward_and_backward_without_kv_gather(h, d_qk, k, hp):
    b, s_q, s_kv = 2, 70, 90
    q = jax.ShapeDtypeStruct((b, s_q, h, d_qk), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s_kv, d_qk), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((b, s_q, k), jnp.int32)
    sink = jax.ShapeDtypeStruct((h,), jnp.float32)

    def loss(q, kv, sink, idx):
        out, _ = sparse_mla(q, kv, idx, sm_scale=0.07, d_v=512, attn_sink=sink,
                            implementation="cuda")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    text = (jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, kv, sink, idx)
            .lower(lowering_platforms=("cuda",)).as_text())
    calls = re.findall(r"stablehlo.custom_call @(\w+)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)", text)
    fwd = [c for c in calls if c[0] == sparse_mla_ffi.CUDA_FWD_TARGET]
    assert len(fwd) == 1, set(c[0] for c in calls)
    assert sum(c[0] == sparse_mla_ffi.CUDA_BWD_TARGET for c in calls) == 1
    _, _, attrs, operand_types, result_types = fwd[0]
    t = b * s_q
    # Batch folded into tokens, heads padded to 64/128, slots passed as they are.
    assert f"tensor<{t}x{hp}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{b * s_kv}x{d_qk}xbf16>" in operand_types
    assert f"tensor<{t}x{k}xi32>" in operand_types
    assert f"tensor<{t}x{hp}x512xbf16>" in result_types
    # No XLA gather of kv rows: the only gathers are of int32 slot ids (the backward's glue).
    for line in text.splitlines():
        if "stablehlo.gather" in line:
            assert "bf16" not in line and "f32" not in line, line
