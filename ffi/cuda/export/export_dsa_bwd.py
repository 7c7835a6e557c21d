"""Build step of the CUDA module: compile the cuDNN frontend's SM90 DSA backward ahead of time.

Instantiates the kernel classes of ``nvidia-cudnn-frontend==1.32.0``
(``cudnn/deepseek_sparse_attention/sparse_attention_backward/dsa_bwd_sm90.py``: preprocess, main,
postprocess) on shape-symbolic fake tensors, compiles them with CuTe DSL (``nvidia-cutlass-dsl``
4.8.x) for ``sm_90a`` and writes each as a C header + object with ``export_to_c``. No GPU and no
PyTorch are needed. It also writes ``dsa_bwd_variants.cc``: one table the FFI handler dispatches
on, with a uniform launcher per variant.

Variants (from ``jax_dsa/kernel_spec.py``, which the public op's glue reads too):
  * dtype bfloat16; heads ``SPARSE_MLA_HEADS`` (the public op pads fewer heads); D_qk
    ``SPARSE_MLA_D_QK``, d_v ``SPARSE_MLA_D_V``; per-row valid counts (``topk_length``) on;
  * slot widths by the ladder ``DSA_BWD_SLOT_BUCKETS`` (indices are padded with -1 to the bucket),
    and one wide variant per (H, D_qk) with K a run-time size, for K past the last bucket.

Tensor layouts follow ``_interface_sm90.py`` of the same release (flat tokens as batch 1).

    python ffi/cuda/export/export_dsa_bwd.py --out-dir DIR [--jobs N]
    python ffi/cuda/export/export_dsa_bwd.py --spec-stamp FILE   # the kernel_spec values it reads
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import importlib.util
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_spec_loader  # noqa: E402

SPEC = kernel_spec_loader.load(
    ("SPARSE_MLA_HEADS", "SPARSE_MLA_D_QK", "SPARSE_MLA_D_V", "DSA_BWD_SLOT_BUCKETS"))
SLOT_BUCKETS = SPEC["DSA_BWD_SLOT_BUCKETS"]
HEADS = SPEC["SPARSE_MLA_HEADS"]
HEAD_DIMS = SPEC["SPARSE_MLA_D_QK"]
D_V = SPEC["SPARSE_MLA_D_V"]
TILE_M = 64
TILE_N = 64
# The wide variant's clamp of topk_length (K is a run-time size there; the handler checks K fits).
WIDE_MAX_TOPK = 1 << 30
FRONTEND_VERSION = "1.32.0"


def _import_kernels():
    """The SM90 kernel module without the torch-based API modules of its package."""
    from importlib import metadata

    have = metadata.version("nvidia-cudnn-frontend")
    if have != FRONTEND_VERSION:
        raise SystemExit(f"export_dsa_bwd: needs nvidia-cudnn-frontend=={FRONTEND_VERSION}, found {have}")
    spec = importlib.util.find_spec("cudnn.deepseek_sparse_attention")
    base = list(spec.submodule_search_locations)[0]
    name = "cudnn.deepseek_sparse_attention.sparse_attention_backward"
    if name not in sys.modules:
        pkg = types.ModuleType(name)  # skip the package __init__ (it imports torch)
        pkg.__path__ = [os.path.join(base, "sparse_attention_backward")]
        sys.modules[name] = pkg
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import dsa_bwd_sm90

    return dsa_bwd_sm90


def _load_runtime():
    # export_to_c links the host launcher through a JIT session that must resolve the CUDA
    # runtime shim's symbols, so the DSL runtime library has to be loaded globally first.
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    root = list(spec.submodule_search_locations)[0]
    lib = os.path.join(root, "cu13", "lib", "libcute_dsl_runtime.so")
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return os.path.join(root, "cu13")


def _fakes():
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor
    from cutlass.runtime import make_fake_stream

    return cutlass, cute, make_fake_tensor, make_fake_stream


def compile_one(kind: str, h: int, d: int, k: int, out_dir: str, arch: str) -> str:
    """Compiles and exports one kernel; returns its prefix."""
    _load_runtime()
    m = _import_kernels()
    cutlass, cute, fake, fake_stream = _fakes()
    bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    bstride = lambda: cute.sym_int64(divisibility=8)  # batch strides (batch is always 1)
    s_q = cute.sym_int32(symbol="S_q")
    s_kv = cute.sym_int32(symbol="S_kv")
    s_q_r = cute.sym_int32(divisibility=TILE_M, symbol="S_q_rounded")
    opts = f"--gpu-arch {arch}"
    if kind == "pre":
        prefix = f"jax_dsa_dsa_bwd_pre_h{h}"
        obj = m._FlashAttentionDSABackwardPreprocessSm90(bf, D_V, 90, TILE_M, num_threads=256)
        o = fake(bf, (1, s_q, h, D_V), (bstride(), h * D_V, D_V, 1), assumed_align=16)
        do = fake(bf, (1, s_q, h, D_V), (bstride(), h * D_V, D_V, 1), assumed_align=16)
        dpsum = fake(f32, (1, s_q_r, h), (bstride(), h, 1), assumed_align=16)
        lse = fake(f32, (1, s_q, h), (bstride(), h, 1), assumed_align=4)
        lse2 = fake(f32, (1, s_q_r, h), (bstride(), h, 1), assumed_align=16)
        sink = fake(f32, (h,), (1,), assumed_align=16)
        dsink = fake(f32, (h,), (1,), assumed_align=16)
        compiled = cute.compile(obj, o, do, dpsum, lse, lse2, sink, dsink, None, None, None,
                                fake_stream(), options=opts)
    elif kind == "main":
        prefix = _prefix(kind, h, d, k)
        # k == 0: the wide variant, K a run-time size (max_topk only clamps each row's
        # topk_length in this kernel, so one compile serves every width past the buckets)
        k_dim = cute.sym_int32(symbol="K") if k == 0 else k
        acc_n = cute.sym_int32(divisibility=TILE_N * 32, symbol="dkv_accum_n")
        obj = m.FlashAttentionDSABackwardSm90(
            bf, d, D_V, h, tile_m=TILE_M, tile_n=TILE_N, KV_stage=1, PdS_stage=1,
            SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, num_threads=256,
            have_topk_length=True, max_topk=WIDE_MAX_TOPK if k == 0 else k)
        q = fake(bf, (1, s_q, h, d), (bstride(), h * d, d, 1), assumed_align=16)
        kv = fake(bf, (1, s_kv, 1, d), (bstride(), d, d, 1), assumed_align=16)
        do = fake(bf, (1, s_q, h, D_V), (bstride(), h * D_V, D_V, 1), assumed_align=16)
        lse2 = fake(f32, (1, s_q_r, h), (bstride(), h, 1), assumed_align=16)
        dpsum = fake(f32, (1, s_q_r, h), (bstride(), h, 1), assumed_align=16)
        dq = fake(bf, (1, s_q, h, d), (bstride(), h * d, d, 1), assumed_align=16)
        dkv_acc = fake(f32, (1, 1, acc_n), (bstride(), bstride(), 1), assumed_align=16)
        topk = fake(i32, (1, s_q, k_dim), (bstride(), k_dim, 1), assumed_align=16)
        tlen = fake(i32, (1, s_q), (bstride(), 1), assumed_align=16)
        compiled = cute.compile(obj, q, kv, do, lse2, dpsum, dq, dkv_acc, topk, tlen,
                                cutlass.Float32(1.0), fake_stream(), options=opts)
    elif kind == "post":
        prefix = f"jax_dsa_dsa_bwd_post_d{d}"
        chunk = 64 if d == 576 else min(128, d)
        obj = m._FlashAttentionDSABackwardPostprocessSm90(
            bf, hdim_chunk=chunk, tile_n=TILE_N, head_dim=d, num_threads=chunk,
            N_hdim_chunks=d // chunk)
        acc_n = cute.sym_int32(divisibility=TILE_N * 32, symbol="dkv_accum_n")
        dkv_acc = fake(f32, (1, 1, acc_n), (bstride(), bstride(), 1), assumed_align=16)
        dkv = fake(bf, (1, s_kv, 1, d), (bstride(), d, d, 1), assumed_align=16)
        compiled = cute.compile(obj, dkv_acc, dkv, cutlass.Int32(1), fake_stream(), options=opts)
    else:
        raise ValueError(kind)
    compiled.export_to_c(out_dir, prefix, prefix)
    return prefix


def _job(args):
    t0 = time.time()
    prefix = compile_one(*args)
    return prefix, time.time() - t0


def variants():
    jobs = [("pre", h, D_V, 0) for h in HEADS]
    jobs += [("post", 0, d, 0) for d in HEAD_DIMS]
    jobs += [("main", h, d, k) for h in HEADS for d in HEAD_DIMS for k in SLOT_BUCKETS + (0,)]
    return jobs


def write_table(out_dir: str, jobs) -> None:
    """dsa_bwd_variants.cc: includes every exported header and fills the dispatch tables."""
    lines = [
        "// Generated by ffi/cuda/export/export_dsa_bwd.py: do not edit.",
        '#include "cuda/dsa_bwd/variants.h"',
        "#define JAX_DSA_PTR(x) const_cast<void*>(static_cast<const void*>(x))",
    ]
    for kind, h, d, k in jobs:
        lines.append(f'#include "{_prefix(kind, h, d, k)}.h"')
    lines += ["", "namespace jax_dsa {", "namespace {"]
    for kind, h, d, k in jobs:
        p = _prefix(kind, h, d, k)
        lines.append(f"{p}_Kernel_Module_t g_{p};")
        lines.append(f"void Load_{p}() {{ {p}_Kernel_Module_Load(&g_{p}); }}")
        if kind == "pre":
            lines.append(f"""int32_t Run_{p}(const DsaBwdLaunch& a) {{
  {p}_Tensor_mO_t o{{JAX_DSA_PTR(a.out), {{a.s_q}}, {{int64_t(a.s_q) * {h * D_V}}}}};
  {p}_Tensor_mdO_t dout{{JAX_DSA_PTR(a.dout), {{a.s_q}}, {{int64_t(a.s_q) * {h * D_V}}}}};
  {p}_Tensor_mdPsum_t dpsum{{JAX_DSA_PTR(a.dpsum), {{a.s_q_rounded}}, {{int64_t(a.s_q_rounded) * {h}}}}};
  {p}_Tensor_mLSE_t lse{{JAX_DSA_PTR(a.lse), {{a.s_q}}, {{int64_t(a.s_q) * {h}}}}};
  {p}_Tensor_mLSElog2_t lse2{{JAX_DSA_PTR(a.lse_log2), {{a.s_q_rounded}}, {{int64_t(a.s_q_rounded) * {h}}}}};
  {p}_Tensor_mAttnSink_t sink{{JAX_DSA_PTR(a.attn_sink)}};
  {p}_Tensor_mdSink_t dsink{{JAX_DSA_PTR(a.d_sink)}};
  return cute_dsl_{p}_wrapper(&g_{p}, &o, &dout, &dpsum, &lse, &lse2, &sink, &dsink, a.stream);
}}""")
        elif kind == "main":
            if k:
                idx_decl = (f"{p}_Tensor_mTopkIdxs_t idx{{JAX_DSA_PTR(a.indices), {{a.s_q}}, "
                            f"{{int64_t(a.s_q) * {k}}}}};")
            else:  # the wide variant: K is a run-time extent and row stride
                idx_decl = (f"{p}_Tensor_mTopkIdxs_t idx{{JAX_DSA_PTR(a.indices), {{a.s_q, a.topk}}, "
                            f"{{int64_t(a.s_q) * a.topk, int64_t(a.topk)}}}};")
            lines.append(f"""int32_t Run_{p}(const DsaBwdLaunch& a) {{
  {p}_Tensor_mQ_t q{{JAX_DSA_PTR(a.q), {{a.s_q}}, {{int64_t(a.s_q) * {h * d}}}}};
  {p}_Tensor_mKV_t kv{{JAX_DSA_PTR(a.kv), {{a.s_kv}}, {{int64_t(a.s_kv) * {d}}}}};
  {p}_Tensor_mdO_t dout{{JAX_DSA_PTR(a.dout), {{a.s_q}}, {{int64_t(a.s_q) * {h * D_V}}}}};
  {p}_Tensor_mLSE_t lse2{{JAX_DSA_PTR(a.lse_log2), {{a.s_q_rounded}}, {{int64_t(a.s_q_rounded) * {h}}}}};
  {p}_Tensor_mdPsum_t dpsum{{JAX_DSA_PTR(a.dpsum), {{a.s_q_rounded}}, {{int64_t(a.s_q_rounded) * {h}}}}};
  {p}_Tensor_mdQ_t dq{{JAX_DSA_PTR(a.dq), {{a.s_q}}, {{int64_t(a.s_q) * {h * d}}}}};
  {p}_Tensor_mdKV_t acc{{JAX_DSA_PTR(a.dkv_accum), {{a.dkv_accum_n}}, {{int64_t(a.dkv_accum_n), int64_t(a.dkv_accum_n)}}}};
  {idx_decl}
  {p}_Tensor_mTopkLength_t len{{JAX_DSA_PTR(a.topk_length), {{a.s_q}}, {{int64_t(a.s_q)}}}};
  return cute_dsl_{p}_wrapper(&g_{p}, &q, &kv, &dout, &lse2, &dpsum, &dq, &acc, &idx, &len,
                              a.sm_scale, a.stream);
}}""")
        else:
            lines.append(f"""int32_t Run_{p}(const DsaBwdLaunch& a) {{
  {p}_Tensor_mdKVaccum_t acc{{JAX_DSA_PTR(a.dkv_accum), {{a.dkv_accum_n}}, {{int64_t(a.dkv_accum_n), int64_t(a.dkv_accum_n)}}}};
  {p}_Tensor_mdKV_t dkv{{JAX_DSA_PTR(a.dkv), {{a.s_kv}}, {{int64_t(a.s_kv) * {d}}}}};
  return cute_dsl_{p}_wrapper(&g_{p}, &acc, &dkv, a.s_kv, a.stream);
}}""")
    lines += ["}  // namespace", ""]
    for kind in ("pre", "main", "post"):
        entries = [j for j in jobs if j[0] == kind]
        lines.append(f"const DsaBwdKernel k{kind.capitalize()}Kernels[] = {{")
        for _, h, d, k in entries:
            p = _prefix(kind, h, d, k)
            lines.append(f'    {{{h}, {d}, {k}, "{p}", &Load_{p}, &Run_{p}}},')
        lines.append("};")
        lines.append(f"const int kNum{kind.capitalize()}Kernels = {len(entries)};")
    lines.append(f"const int kDsaBwdDv = {D_V};")
    lines.append(f'const char kDsaBwdSupported[] = "H must be {words(HEADS)}, D_qk '
                 f'{words(HEAD_DIMS)}";')
    lines += ["", "}  // namespace jax_dsa", ""]
    with open(os.path.join(out_dir, "dsa_bwd_variants.cc"), "w") as f:
        f.write("\n".join(lines))


def words(values) -> str:
    """(64, 128) -> "64 or 128", for the handlers' messages."""
    v = [str(x) for x in values]
    return v[0] if len(v) == 1 else ", ".join(v[:-1]) + " or " + v[-1]


def _prefix(kind, h, d, k):
    return {"pre": f"jax_dsa_dsa_bwd_pre_h{h}", "post": f"jax_dsa_dsa_bwd_post_d{d}",
            "main": f"jax_dsa_dsa_bwd_main_h{h}_d{d}_k{k if k else 'any'}"}[kind]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--print-runtime-dir", action="store_true",
                    help="print the CuTe DSL cu13 folder (headers, static runtime) and exit")
    ap.add_argument("--list-outputs", action="store_true",
                    help="print the object files the export writes (one per line) and exit")
    ap.add_argument("--spec-stamp", metavar="FILE",
                    help="write the kernel_spec values the export reads to FILE (only if they "
                         "changed) and exit")
    args = ap.parse_args()
    if args.spec_stamp:
        kernel_spec_loader.write_stamp(args.spec_stamp, SPEC)
        return
    if args.print_runtime_dir:
        _import_kernels()  # also checks the frontend version
        print(_load_runtime())
        return
    if args.list_outputs:
        for kind, h, d, k in variants():
            print(_prefix(kind, h, d, k) + ".o")
        return
    if not args.out_dir:
        ap.error("--out-dir is required")
    os.makedirs(args.out_dir, exist_ok=True)
    jobs = variants()
    t0 = time.time()
    work = [(kind, h, d, k, args.out_dir, args.arch) for kind, h, d, k in jobs]
    # One process per kernel: CuTe DSL compiles are single-threaded and keep global state.
    ctx = __import__("multiprocessing").get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for prefix, dt in pool.map(_job, work):
            print(f"export_dsa_bwd: {prefix} ({dt:.1f} s)", flush=True)
    write_table(args.out_dir, jobs)
    print(f"export_dsa_bwd: {len(jobs)} kernels for {args.arch} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
