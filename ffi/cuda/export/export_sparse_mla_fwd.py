"""Build step of the CUDA module: compile jax_dsa's own SM90 sparse MLA forward ahead of time.

Compiles ``SparseMlaFwdSm90`` (``ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py``, CuTe DSL,
``nvidia-cutlass-dsl`` 4.8.x) for ``sm_90a`` on shape-symbolic fake tensors (S_q, S_kv and K are
run-time sizes) and writes each variant as a C header + object with ``export_to_c``, plus
``sparse_mla_fwd_variants.cc``: the dispatch table the FFI handlers
(``ffi/cuda/sparse_mla_fwd/handler.cc``) read. No GPU is needed.

Variants (from ``jax_dsa/kernel_spec.py``, which the public op's glue reads too): heads
``SPARSE_MLA_HEADS`` (the public op pads fewer heads), D_qk ``SPARSE_MLA_D_QK``, d_v
``SPARSE_MLA_D_V`` (checked against the kernel's own); K a multiple of
``SPARSE_MLA_FWD_K_MULTIPLE`` (a run-time size, checked by the handler). Each in three modes:
attention over slot lists (``sparse_mla``), attention over contiguous runs of kv rows
(``dense_mla``'s causal dense attention), and the indexer loss's target over slot lists (per-slot
head sums of the attention probabilities from a given lse; ``SparseMlaFwdSm90``'s docstring).

    python ffi/cuda/export/export_sparse_mla_fwd.py --out-dir DIR [--jobs N]
    python ffi/cuda/export/export_sparse_mla_fwd.py --spec-stamp FILE   # the kernel_spec values it reads
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import importlib.util
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import kernel_spec_loader  # noqa: E402

# The kernel's source (imported by compile_one, where CuTe DSL is loaded).
KERNEL_DIR = os.path.join(os.path.dirname(_HERE), "sparse_mla_fwd")

SPEC = kernel_spec_loader.load(
    ("SPARSE_MLA_HEADS", "SPARSE_MLA_D_QK", "SPARSE_MLA_D_V", "SPARSE_MLA_FWD_K_MULTIPLE"))
HEADS = SPEC["SPARSE_MLA_HEADS"]
HEAD_DIMS = SPEC["SPARSE_MLA_D_QK"]
D_V = SPEC["SPARSE_MLA_D_V"]
K_MULTIPLE = SPEC["SPARSE_MLA_FWD_K_MULTIPLE"]


def _load_runtime():
    # export_to_c links the host launcher through a JIT session that must resolve the CUDA
    # runtime shim's symbols, so the DSL runtime library has to be loaded globally first.
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if spec is None:
        raise SystemExit("export_sparse_mla_fwd: nvidia-cutlass-dsl is not installed")
    root = list(spec.submodule_search_locations)[0]
    ctypes.CDLL(os.path.join(root, "cu13", "lib", "libcute_dsl_runtime.so"), mode=ctypes.RTLD_GLOBAL)
    return os.path.join(root, "cu13")


def prefix(h: int, d: int, contiguous: bool = False, target: bool = False) -> str:
    return (f"jax_dsa_{'dense' if contiguous else 'sparse'}_mla_{'target' if target else 'fwd'}"
            f"_h{h}_d{d}")


def compile_one(h: int, d: int, contiguous: bool, target: bool, out_dir: str, arch: str) -> str:
    _load_runtime()
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor as fake
    from cutlass.runtime import make_fake_stream

    sys.path.insert(0, KERNEL_DIR)
    import sparse_mla_fwd_sm90
    from sparse_mla_fwd_sm90 import SparseMlaFwdSm90

    if sparse_mla_fwd_sm90.D_V != D_V:  # the kernel's layouts are written for its own d_v
        raise RuntimeError(f"export_sparse_mla_fwd: kernel_spec SPARSE_MLA_D_V={D_V}, but "
                           f"sparse_mla_fwd_sm90.py is written for d_v {sparse_mla_fwd_sm90.D_V}")

    bf, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    s_q = cute.sym_int32(symbol="S_q")
    s_kv = cute.sym_int32(symbol="S_kv")
    k = cute.sym_int32(symbol="K")
    q = fake(bf, (s_q, h, d), (h * d, d, 1), assumed_align=16)
    kv = fake(bf, (s_kv, d), (d, 1), assumed_align=16)
    idx = fake(i32, (s_q, k), (k, 1), assumed_align=4)
    length = fake(i32, (s_q,), (1,), assumed_align=4)
    sink = fake(f32, (h,), (1,), assumed_align=4)
    if target:  # the target's mass [S_q * H / 64, K_out] float32 in place of the output
        tiles = cute.sym_int32(symbol="tiles")
        k_out = cute.sym_int32(symbol="K_out")
        out = fake(f32, (tiles, k_out), (k_out, 1), assumed_align=4)
    else:
        out = fake(bf, (s_q, h, D_V), (h * D_V, D_V, 1), assumed_align=16)
    lse = fake(f32, (s_q, h), (h, 1), assumed_align=4)
    mx = fake(f32, (s_q, h), (h, 1), assumed_align=4)
    # sm_scale and n_ctas (the persistent grid) are run-time scalars
    compiled = cute.compile(SparseMlaFwdSm90(h, d, contiguous, target), q, kv, idx, length, sink, out, lse, mx,
                            cutlass.Float32(1.0), cutlass.Int32(1), make_fake_stream(),
                            options=f"--gpu-arch {arch}")
    p = prefix(h, d, contiguous, target)
    compiled.export_to_c(out_dir, p, p)
    return p


def _job(args):
    t0 = time.time()
    return compile_one(*args), time.time() - t0


def variants():
    """(H, D_qk, contiguous, target): attention over slot lists (sparse_mla), over contiguous
    runs (dense_mla), then the indexer loss's target over slot lists."""
    return ([(h, d, c, False) for c in (False, True) for h in HEADS for d in HEAD_DIMS]
            + [(h, d, False, True) for h in HEADS for d in HEAD_DIMS])


def words(values) -> str:
    """(64, 128) -> "64 or 128", for the handler's messages."""
    v = [str(x) for x in values]
    return v[0] if len(v) == 1 else ", ".join(v[:-1]) + " or " + v[-1]


def write_table(out_dir: str) -> None:
    lines = [
        "// Generated by ffi/cuda/export/export_sparse_mla_fwd.py: do not edit.",
        '#include "cuda/sparse_mla_fwd/variants.h"',
        "#define JAX_DSA_PTR(x) const_cast<void*>(static_cast<const void*>(x))",
    ]
    for v in variants():
        lines.append(f'#include "{prefix(*v)}.h"')
    lines += ["", "namespace jax_dsa {", "namespace {"]
    for h, d, c, tg in variants():
        p = prefix(h, d, c, tg)
        out_init = "{a.out_rows, a.out_cols}, {int64_t(a.out_cols)}" if tg else "{a.s_q}"
        lines.append(f"{p}_Kernel_Module_t g_{p};")
        lines.append(f"void Load_{p}() {{ {p}_Kernel_Module_Load(&g_{p}); }}")
        lines.append(f"""int32_t Run_{p}(const SparseMlaFwdLaunch& a) {{
  {p}_Tensor_mQ_t q{{JAX_DSA_PTR(a.q), {{a.s_q}}}};
  {p}_Tensor_mKV_t kv{{JAX_DSA_PTR(a.kv), {{a.s_kv}}}};
  {p}_Tensor_mIdx_t idx{{JAX_DSA_PTR(a.indices), {{a.s_q, a.topk}}, {{int64_t(a.topk)}}}};
  {p}_Tensor_mLen_t len{{JAX_DSA_PTR(a.topk_length), {{a.s_q}}}};
  {p}_Tensor_mSink_t sink{{JAX_DSA_PTR(a.attn_sink)}};
  {p}_Tensor_mOut_t out{{JAX_DSA_PTR(a.out), {out_init}}};
  {p}_Tensor_mLse_t lse{{JAX_DSA_PTR(a.lse), {{a.s_q}}}};
  {p}_Tensor_mMax_t mx{{JAX_DSA_PTR(a.max_logits), {{a.s_q}}}};
  return cute_dsl_{p}_wrapper(&g_{p}, &q, &kv, &idx, &len, &sink, &out, &lse, &mx, a.sm_scale,
                              a.num_ctas, a.stream);
}}""")
    lines += ["}  // namespace", "", "const SparseMlaFwdKernel kSparseMlaFwdKernels[] = {"]
    for h, d, c, tg in variants():
        p = prefix(h, d, c, tg)
        lines.append(f'    {{{h}, {d}, {int(c)}, {int(tg)}, "{p}", &Load_{p}, &Run_{p}}},')
    lines += ["};", f"const int kNumSparseMlaFwdKernels = {len(variants())};",
              f"const int kSparseMlaFwdDv = {D_V};",
              f"const int kSparseMlaFwdKMultiple = {K_MULTIPLE};",
              f'const char kSparseMlaFwdSupported[] = "H must be {words(HEADS)}, D_qk '
              f'{words(HEAD_DIMS)}";', "", "}  // namespace jax_dsa", ""]
    with open(os.path.join(out_dir, "sparse_mla_fwd_variants.cc"), "w") as f:
        f.write("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--list-outputs", action="store_true",
                    help="print the object files the export writes (one per line) and exit")
    ap.add_argument("--spec-stamp", metavar="FILE",
                    help="write the kernel_spec values the export reads to FILE (only if they "
                         "changed) and exit")
    args = ap.parse_args()
    if args.spec_stamp:
        kernel_spec_loader.write_stamp(args.spec_stamp, SPEC)
        return
    if args.list_outputs:
        for v in variants():
            print(prefix(*v) + ".o")
        return
    if not args.out_dir:
        ap.error("--out-dir is required")
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    work = [(*v, args.out_dir, args.arch) for v in variants()]
    ctx = __import__("multiprocessing").get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for p, dt in pool.map(_job, work):
            print(f"export_sparse_mla_fwd: {p} ({dt:.1f} s)", flush=True)
    write_table(args.out_dir)
    print(f"export_sparse_mla_fwd: {len(work)} kernels for {args.arch} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
