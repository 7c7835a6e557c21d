"""The CUDA module as built (no GPU needed): it loads (or says why not) with the kernel
variants the glue expects, the compile-only SM100/SM103 artifacts and their manifest, and the
benchmarks' raw-pointer entries kept out of it. The ops' CUDA glue, lowering and numerics:
tests/test_ops_*_cuda.py.
"""

import os
import shutil

import pytest

from jax_dsa import _native
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
