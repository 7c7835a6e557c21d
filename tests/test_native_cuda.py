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
from jax_dsa.ops import registry
from jax_dsa.ops import sparse_mla as sparse_mla_module
from jax_dsa.ops.sparse_mla import cpu as sparse_mla_cpu
from jax_dsa.ops.sparse_mla import cuda as sparse_mla_cuda

# CI builds with nvcc on PATH, so there the module must be present (JAX_DSA_CUDA=OFF opts out).
EXPECT_CUDA = shutil.which("nvcc") is not None and os.environ.get("JAX_DSA_CUDA", "AUTO") != "OFF"


def test_cuda_module_loads_or_reports_why():
    if "cuda" in _native.available():
        mod = _native.require("_cuda")
        assert tuple(mod.FFI_API_VERSION) == (0, 4)
        variants = set(map(tuple, mod.variants()))
        want = {(h, d, k) for h in sparse_mla_cuda.KERNEL_HEADS for d in sparse_mla_cuda.KERNEL_D_QK
                for k in sparse_mla_cuda.SLOT_BUCKETS + (0,)}
        assert variants == want  # the glue's buckets (and 0: the wide variant) are compiled
        # The handler's workspace formula and the glue's agree (frontend 1.32 SM90 formula).
        for s_q, s_kv, h, d in [(200, 1000, 64, 576), (77, 3000, 128, 512), (1, 1, 64, 512)]:
            assert mod.workspace_bytes(s_q, s_kv, h, d) == sparse_mla_cuda.cuda_workspace_bytes(
                s_q, s_kv, h, d)
        assert mod.workspace_bytes(200, 1000, 64, 576) == 2 * 65536 + 1024 * 576 * 4
    else:
        reason = _native.LOAD_ERRORS.get("_cuda", "")
        assert "_cuda" in reason or "cuda" in reason.lower(), reason
        with pytest.raises(NotImplementedError, match="_cuda"):
            _native.require("_cuda")
        assert not EXPECT_CUDA, f"nvcc is on PATH but the CUDA module did not load: {reason}"


def _cuda_runs_here():
    return ("cuda" in _native.available() and jax.default_backend() == "gpu"
            and registry.sm90_device_error() is None)


needs_cuda = pytest.mark.skipif("cuda" not in _native.available(),
                                reason=f"CUDA module not built: {_native.LOAD_ERRORS.get('_cuda')}")


def _lower_cuda_grad(b, s_q, s_kv, h, d_qk, k, return_max_logits=False):
    """StableHLO text of jax.grad of sparse_mla(implementation="cuda") lowered for CUDA, and
    its custom calls as (target, operands, attributes, operand types, result types). With
    ``return_max_logits`` the loss also sums max_logits (which takes no gradient)."""
    q = jax.ShapeDtypeStruct((b, s_q, h, d_qk), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s_kv, d_qk), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((b, s_q, k), jnp.int32)
    sink = jax.ShapeDtypeStruct((h,), jnp.float32)

    def loss(q, kv, sink, idx):
        res = sparse_mla(q, kv, idx, sm_scale=0.07, d_v=512, attn_sink=sink,
                         implementation="cuda", return_max_logits=return_max_logits)
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


def _glue_oracle(idx, length, s_kv, k_out):
    """The backward glue's contract in numpy: each row's valid slots (in range, before
    topk_length) as global rows first, in order, -1 after; an empty row gets row 0 of its batch
    element."""
    nb, s_q, k = idx.shape
    want = np.full((nb, s_q, k_out), -1, np.int32)
    count = np.zeros((nb, s_q), np.int32)
    for b in range(nb):
        for t in range(s_q):
            valid = [int(j) + b * s_kv for pos, j in enumerate(idx[b, t])
                     if 0 <= j < s_kv and pos < length[b, t]]
            count[b, t] = len(valid)
            want[b, t, :len(valid)] = valid
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


@pytest.mark.skipif(not _cuda_runs_here(), reason="needs the CUDA module and an SM90 GPU")
@pytest.mark.parametrize("seed,nb,s_q,s_kv,k,k_out", [
    (2, 2, 9, 7, 5, 5), (3, 2, 9, 7, 5, 12),        # bucket padding
    (4, 1, 300, 5000, 2048, 2048),                  # one tile of the kernel exactly
    (5, 2, 40, 900, 4500, 4608)])                   # several tiles a row
def test_glue_on_the_gpu_matches_the_contract(seed, nb, s_q, s_kv, k, k_out):
    idx, length, s_kv = _glue_case(seed, nb, s_q, s_kv, k)
    idx[0, 0] = -1  # an empty row
    length[-1, -1] = k
    idx[-1, -1] = np.arange(k) % s_kv  # a full row
    g_idx, g_len, empty = map(np.asarray, jax.jit(
        sparse_mla_cuda.cuda_index_glue, static_argnums=(2, 3))(
            jnp.asarray(idx), jnp.asarray(length), s_kv, k_out))
    want, want_len, want_empty = _glue_oracle(idx, length, s_kv, k_out)
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


# SM100/SM103 (Blackwell) kernels: exported at build time as compile-only artifacts (they cannot
# run on SM90), installed with a manifest into jax_dsa/kernels/sm100, never linked into _cuda.
EXPECT_SM100 = os.environ.get("JAX_DSA_CUDA_SM100", "ON") != "OFF"
SM100_ARCHS = ("sm_100a", "sm_103a")


def _sm100_manifest():
    import json

    import jax_dsa

    if "cuda" not in _native.available():
        pytest.skip(f"CUDA module not built: {_native.LOAD_ERRORS.get('_cuda')}")
    for root in jax_dsa.__path__:  # the editable install keeps built files in site-packages
        path = os.path.join(root, "kernels", "sm100", "manifest.json")
        if os.path.isfile(path):
            with open(path) as f:
                return os.path.dirname(path), json.load(f)
    if not EXPECT_SM100:
        pytest.skip("built with JAX_DSA_CUDA_SM100=OFF: no SM100/SM103 artifacts")
    pytest.fail(f"the CUDA module is built but no kernels/sm100/manifest.json under {jax_dsa.__path__}")


def _elf_sections(blob):
    """(e_flags, EI_ABIVERSION, e_machine, {section name: (type, bytes)}) of an ELF64 LE image."""
    import struct

    assert blob[:4] == b"\x7fELF" and blob[4] == 2 and blob[5] == 1, "not an ELF64 LE image"
    e_machine = struct.unpack_from("<H", blob, 18)[0]
    e_flags = struct.unpack_from("<I", blob, 48)[0]
    shoff = struct.unpack_from("<Q", blob, 40)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 58)
    heads = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]

    def name(off):
        return blob[names_at + off:blob.index(b"\0", names_at + off)].decode()

    sections = {name(h[0]): (h[1], blob[h[4]:h[4] + h[5]] if h[1] != 8 else b"") for h in heads}
    return e_flags, blob[8], e_machine, sections


def _defined_globals(obj):
    """Global symbols an ELF64 relocatable object defines (its .symtab)."""
    import struct

    _, _, _, sections = _elf_sections(obj)
    symtab, strtab = sections[".symtab"][1], sections[".strtab"][1]
    out = set()
    for i in range(0, len(symtab), 24):
        st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", symtab, i)
        if st_info >> 4 == 1 and st_shndx != 0:  # STB_GLOBAL, defined
            out.add(strtab[st_name:strtab.index(b"\0", st_name)].decode())
    return out


def test_sm100_manifest_lists_the_blackwell_artifacts():
    folder, manifest = _sm100_manifest()
    got = {(a["arch"], a["heads"], a["d_qk"], a["slot_bucket"]) for a in manifest["artifacts"]}
    # H64 at every bucket; H128 only at 640: at 512 and 2048 the frontend runs its two-CTA classes.
    want = {(arch, 64, d, k) for arch in SM100_ARCHS for d in (512, 576) for k in (512, 640, 2048)}
    want |= {(arch, 128, d, 640) for arch in SM100_ARCHS for d in (512, 576)}
    assert got == want
    assert len(manifest["artifacts"]) == len(want)
    assert {(n["heads"], n["d_qk"], n["slot_bucket"]) for n in manifest["not_exported"]} == {
        (128, d, k) for d in (512, 576) for k in (512, 2048)}
    assert manifest["frontend"] == "nvidia-cudnn-frontend==1.32.0"
    assert manifest["dtype"] == "bfloat16" and manifest["topk_length"] is True
    for a in manifest["artifacts"]:
        assert a["frontend_backend"] == "generic_m64" and a["d_v"] == 512
        for key in ("object", "header"):
            assert os.path.isfile(os.path.join(folder, a[key])), a[key]
        with open(os.path.join(folder, a["header"])) as f:
            header = f.read()
        assert f"int32_t {a['symbols']['wrapper']}(" in header
        assert f"void {a['symbols']['module_load']}(" in header
    # The workspace examples (the frontend's own size function at build time) against the
    # generic non-deterministic SM100 formula (nvidia-cudnn-frontend 1.32.0).
    ws = manifest["workspace"]
    r8, a128 = (lambda x: -(-x // 8) * 8), (lambda x: -(-x // 128) * 128)
    assert {(e["heads"], e["d_qk"]) for e in ws["examples"]} == {(64, 512), (64, 576), (128, 512),
                                                                 (128, 576)}
    for e in ws["examples"]:
        h, d, s_q, s_kv = e["heads"], e["d_qk"], e["s_q"], e["s_kv"]
        assert e["bytes"] == a128(h * r8(s_q) * 8) + a128(r8(s_kv) * r8(d) * 4), e
    assert ws["caller_zeroes"] == ["d_sink"]


def test_sm100_objects_hold_device_code_for_their_arch():
    folder, manifest = _sm100_manifest()
    for a in manifest["artifacts"]:
        with open(os.path.join(folder, a["object"]), "rb") as f:
            obj = f.read()
        assert set(a["symbols"]["object"]) <= _defined_globals(obj), a["object"]
        starts = [i for i in range(1, len(obj)) if obj.startswith(b"\x7fELF", i)]
        assert len(starts) == 1, f"{a['object']}: {len(starts)} embedded device images"
        e_flags, abi, e_machine, sections = _elf_sections(obj[starts[0]:])
        assert e_machine == 190, "not EM_CUDA"
        # LLVM BinaryFormat/ELF.h: CUDA ELF ABI v8 keeps the SM in bits 8-15, older ones in 0-7.
        sm = (e_flags >> 8) & 0xFF if abi >= 8 else e_flags & 0xFF
        assert sm == int(a["arch"][3:6]), (a["object"], hex(e_flags))
        # ptxas records its target, which also tells sm_100a from sm_100.
        assert f"-arch {a['arch']} ".encode() in sections[".note.nv.tkinfo"][1], a["object"]
        text = {n: len(b) for n, (t, b) in sections.items() if n.startswith(".text.")}
        assert all(size > 0 for size in text.values())
        # The five launches of one call, one kernel each.
        kernels = ("clear_dKV_workspace", "sum_OdO", "bwd", "convert", "sum_dSink")
        assert sorted(n.split("_cudnn")[0] for n in text) == sorted(
            f".text.kernel_cutlass_{k}" for k in kernels), (a["object"], sorted(text))


def test_sm100_artifacts_are_not_linked_into_the_cuda_module():
    _, manifest = _sm100_manifest()
    with open(_native.require("_cuda").__file__, "rb") as f:
        module = f.read()
    for a in manifest["artifacts"]:
        assert a["symbols"]["wrapper"].encode() not in module
        assert a["object"][:-2].encode() not in module
    assert b"jax_dsa_dsa_bwd_main_h64_d576_k2048" in module  # the SM90 kernels are


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


# The benchmarks' raw-pointer entries live in a library of their own beside _cuda, never in it.
BENCH_ENTRIES = ("jax_dsa_dsa_bwd_raw_bench", "jax_dsa_sparse_mla_fwd_raw_bench")
EXPECT_BENCH = os.environ.get("JAX_DSA_CUDA_BENCH", "ON") != "OFF"


def test_benchmark_entries_are_in_the_bench_library_only():
    import ctypes

    if "cuda" not in _native.available():
        pytest.skip(f"CUDA module not built: {_native.LOAD_ERRORS.get('_cuda')}")
    module = ctypes.CDLL(_native.require("_cuda").__file__)
    for name in BENCH_ENTRIES:
        assert not hasattr(module, name), f"{name} is exported by the production module"
    try:
        path = _native.bench_library()
    except FileNotFoundError:
        if EXPECT_BENCH:
            raise
        pytest.skip("built with JAX_DSA_CUDA_BENCH=OFF: no benchmark library")
    assert os.path.dirname(path) == os.path.dirname(_native.require("_cuda").__file__)
    bench = ctypes.CDLL(path)
    for name in BENCH_ENTRIES:
        assert hasattr(bench, name), f"{name} is missing from {path}"
