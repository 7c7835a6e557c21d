"""Build step: the cuDNN frontend's SM100-family DSA backward as compile-only artifacts.

Compiles the generic Blackwell kernel class of ``nvidia-cudnn-frontend==1.32.0``
(``cudnn/deepseek_sparse_attention/sparse_attention_backward/dsa_bwd_sm100.py``,
``FlashAttentionDSABackwardSm100``, the frontend's ``generic_m64`` backend) with CuTe DSL for
``sm_100a`` (B200) and ``sm_103a`` (B300) on shape-symbolic fake tensors, as the frontend's own
plan compile (``_interface_sm100._compile_sm100_artifact``) does but without ``--enable-tvm-ffi``
(plain C ABI), and writes each with ``export_to_c`` as a C header + object, plus
``manifest.json`` describing them. No GPU and no PyTorch are needed.

These artifacts cannot run on the project's GPUs (H200, SM90): they are built and installed
(``jax_dsa/kernels/sm100/``) so that a Blackwell handler can be written against them, but no
handler links or dispatches to them.

Variants (one object per arch, heads, D_qk, slot bucket):
  * dtype bfloat16, d_v 512, per-row valid counts (``topk_length``) on, non-deterministic;
  * heads 64; heads 128 only where the frontend also runs the generic class (for H128 at the
    widths its tuned two-CTA classes cover, it selects those instead: listed as not exported);
  * D_qk 512 and 576; slot buckets ``SLOT_BUCKETS`` (a reduced ladder: build time).
Heads, D_qk, d_v and the buckets come from ``jax_dsa/kernel_spec.py`` (``SPARSE_MLA_HEADS``,
``SPARSE_MLA_D_QK``, ``SPARSE_MLA_D_V``, ``DSA_BWD_SM100_SLOT_BUCKETS``).

Each exported function takes the frontend's ``problem_shape`` flattened (the header generator
refuses nested tuples) ahead of the tensors, so the compiled code is the frontend's.

    python ffi/cuda/export/export_dsa_bwd_sm100.py --out-dir DIR [--jobs N]
    python ffi/cuda/export/export_dsa_bwd_sm100.py --spec-stamp FILE   # the kernel_spec values it reads
"""

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time

# The SM90 build step's helpers: frontend version check, torch-free import, DSL runtime.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_dsa_bwd as sm90  # noqa: E402
import kernel_spec_loader  # noqa: E402

SPEC = kernel_spec_loader.load(
    ("SPARSE_MLA_HEADS", "SPARSE_MLA_D_QK", "SPARSE_MLA_D_V", "DSA_BWD_SM100_SLOT_BUCKETS"))
ARCHS = ("sm_100a", "sm_103a")
SLOT_BUCKETS = SPEC["DSA_BWD_SM100_SLOT_BUCKETS"]
HEADS = SPEC["SPARSE_MLA_HEADS"]
HEAD_DIMS = SPEC["SPARSE_MLA_D_QK"]
D_V = SPEC["SPARSE_MLA_D_V"]
BLOCK_TILE = 64
# _interface_sm100._select_sm100_backend (1.32.0): on SM100/SM103, bf16, contiguous inputs, H128
# with these widths runs the two-CTA classes (h128_2cta_m64 for D 512, h128_d576_2cta_m64 for 576).
TWO_CTA_TOPK = (128, 512, 1024, 1152, 2048)
KERNEL_CLASS = ("cudnn.deepseek_sparse_attention.sparse_attention_backward.dsa_bwd_sm100."
                "FlashAttentionDSABackwardSm100")
MANIFEST = "manifest.json"


def frontend_backend(h: int, d: int, k: int) -> str:
    """The backend the frontend selects for (H, D_qk, K) on SM100/SM103, for H in HEADS only."""
    if h == 128 and k in TWO_CTA_TOPK:
        return "h128_2cta_m64" if d == 512 else "h128_d576_2cta_m64"
    return "generic_m64"


def prefix(arch: str, h: int, d: int, k: int) -> str:
    return f"jax_dsa_dsa_bwd_{arch.replace('_', '')}_h{h}_d{d}_k{k}"


def variants():
    return [(a, h, d, k) for a in ARCHS for h in HEADS for d in HEAD_DIMS for k in SLOT_BUCKETS
            if frontend_backend(h, d, k) == "generic_m64"]


def skipped():
    return [(h, d, k, frontend_backend(h, d, k)) for h in HEADS for d in HEAD_DIMS
            for k in SLOT_BUCKETS if frontend_backend(h, d, k) != "generic_m64"]


def _import_sm100():
    sm90._import_kernels()  # version check; registers the backward package without its __init__
    from cudnn.deepseek_sparse_attention.sparse_attention_backward import (
        _interface_sm100_common, dsa_bwd_sm100)

    return dsa_bwd_sm100, _interface_sm100_common


def compile_one(arch: str, h: int, d: int, k: int, out_dir: str):
    """Compiles and exports one kernel; returns its manifest entry and the seconds it took."""
    t0 = time.time()
    sm90._load_runtime()
    m, _ = _import_sm100()
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    bf, f32, i32, u8 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32, cutlass.Uint8
    Int32 = cutlass.Int32

    def fake(dtype, shape, align=16):  # row-major, as the frontend's _fake_compact_tensor
        return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                        assumed_align=align)

    kernel = m.FlashAttentionDSABackwardSm100(element_dtype=bf, head_dim=d, head_dim_v=D_V,
                                              block_tile=BLOCK_TILE, max_topk=k)

    class FlatProblemShape:
        """The kernel's call with problem_shape = (s_q, s_kv, d_qk, (num_heads, batch)) flattened."""

        def __init__(self, kernel):
            self.kernel = kernel

        @cute.jit
        def __call__(self, s_q: Int32, s_kv: Int32, d_qk: Int32, num_heads: Int32, batch: Int32,
                     mQ: cute.Tensor, mKV: cute.Tensor, mOut: cute.Tensor, mdO: cute.Tensor,
                     mLSE: cute.Tensor, mAttnSink: cute.Tensor, mTopkIdxs: cute.Tensor,
                     mTopkLength: cute.Tensor, mdQ: cute.Tensor, mdKV: cute.Tensor,
                     mdSink: cute.Tensor, mWorkspaceLSE: cute.Tensor, mWorkspaceDKV: cute.Tensor,
                     sm_scale: cutlass.Float32, stream: cuda.CUstream):
            self.kernel((s_q, s_kv, d_qk, (num_heads, batch)), mQ, mKV, mOut, mdO, mLSE, mAttnSink,
                        mTopkIdxs, mTopkLength, mdQ, mdKV, mdSink, mWorkspaceLSE, mWorkspaceDKV,
                        sm_scale, stream)

    s_q, s_kv = cute.sym_int(), cute.sym_int()
    args = [
        fake(bf, (s_q, h, d)), fake(bf, (s_kv, d)),                    # q, kv
        fake(bf, (s_q, h, D_V)), fake(bf, (s_q, h, D_V)),              # out, dout
        fake(f32, (s_q, h), 8), fake(f32, (h,)),                       # lse, attn_sink
        fake(i32, (s_q, k)), fake(i32, (s_q,), 4),                     # indices, topk_length
        fake(bf, (s_q, h, d)), fake(bf, (s_kv, d)), fake(f32, (h,)),   # dq, dkv, d_sink
        fake(u8, (1, h, cute.sym_int(), 8)),                           # workspace: LSE and O.dO
        fake(u8, (1, 1, cute.sym_int(), d * 4)),                       # workspace: fp32 dKV
    ]
    # problem_shape values are runtime Int32s, as in the frontend's compile (placeholders here).
    compiled = cute.compile(FlatProblemShape(kernel), Int32(1), Int32(1), Int32(d), Int32(h),
                            Int32(1), *args, cutlass.Float32(1.0), make_fake_stream(),
                            options=f"--gpu-arch {arch}")
    p = prefix(arch, h, d, k)
    compiled.export_to_c(out_dir, p, p)
    with open(os.path.join(out_dir, p + ".h")) as f:
        header = f.read()
    # Functions the header declares and the object defines (everything else is static inline).
    extern = sorted(set(re.findall(r"^void (\w+)\(", header, re.M)))
    wrapper = f"cute_dsl_{p}_wrapper"
    if wrapper not in header or not extern:
        raise SystemExit(f"export_dsa_bwd_sm100: unexpected header layout in {p}.h")
    return {
        "arch": arch, "heads": h, "d_qk": d, "d_v": D_V, "slot_bucket": k,
        "frontend_backend": "generic_m64", "object": p + ".o", "header": p + ".h",
        "symbols": {"wrapper": wrapper, "module_load": f"{p}_Kernel_Module_Load",
                    "module_unload": f"{p}_Kernel_Module_Unload", "object": extern},
    }, time.time() - t0


def _job(args):
    return compile_one(*args)


WORKSPACE_FORMULA = "align128(H * round8(S_q) * 8) + align128(round8(S_kv) * round8(D_qk) * 4)"
WORKSPACE_SAMPLES = ((1, 1), (77, 3000), (200, 1000), (16384, 16384))


def workspace_bytes(s_q: int, s_kv: int, h: int, d: int) -> int:
    """The generic non-deterministic SM100 workspace, written from the kernel's two segments."""
    r8 = lambda x: -(-x // 8) * 8
    a128 = lambda x: -(-x // 128) * 128
    return a128(h * r8(s_q) * 8) + a128(r8(s_kv) * r8(d) * 4)


def workspace_section() -> dict:
    """The workspace contract, checked against the frontend's own size function."""
    _, common = _import_sm100()
    examples = []
    for h in HEADS:
        for d in HEAD_DIMS:
            for s_q, s_kv in WORKSPACE_SAMPLES:
                ref = common.flash_attn_bwd_sm100_workspace_size(s_q, s_kv, d, h, False,
                                                                 backend="generic_m64")
                if ref != workspace_bytes(s_q, s_kv, h, d):
                    raise SystemExit(f"export_dsa_bwd_sm100: workspace formula disagrees with the "
                                     f"frontend at S_q={s_q} S_kv={s_kv} H={h} D={d}: {ref}")
                examples.append({"s_q": s_q, "s_kv": s_kv, "heads": h, "d_qk": d, "bytes": ref})
    return {
        "formula_bytes": WORKSPACE_FORMULA,
        "source": "flash_attn_bwd_sm100_workspace_size(S_q, S_kv, D_qk, H, deterministic=False) "
                  "in _interface_sm100_common.py (frontend 1.32.0)",
        "segments": [
            {"arg": "mWorkspaceLSE", "offset": "0",
             "tensor": "uint8 [1, H, round8(S_q), 8] (fp32 sum O.dO, then fp32 scaled LSE)"},
            {"arg": "mWorkspaceDKV", "offset": "align128(H * round8(S_q) * 8)",
             "tensor": "uint8 [1, 1, round8(S_kv), D_qk * 4] (fp32 dKV accumulator)"},
        ],
        "caller_zeroes": ["d_sink"],
        "kernel_clears": ["dKV accumulator"],
        "examples": examples,
    }


def write_manifest(out_dir: str, entries) -> None:
    from importlib import metadata

    manifest = {
        "description": "cuDNN frontend SM100-family DSA backward, compiled ahead of time with "
                       "CuTe DSL: compile-only artifacts, not linked into jax_dsa._cuda",
        "runs_on": "SM100 (B200: sm_100a) and SM103 (B300: sm_103a) GPUs only; untested",
        "frontend": f"nvidia-cudnn-frontend=={metadata.version('nvidia-cudnn-frontend')}",
        "cute_dsl": f"nvidia-cutlass-dsl=={metadata.version('nvidia-cutlass-dsl')}",
        "kernel_class": KERNEL_CLASS,
        "dtype": "bfloat16", "deterministic": False, "topk_length": True,
        "block_tile": BLOCK_TILE, "slot_buckets": list(SLOT_BUCKETS),
        "call": {
            "wrapper_args": ["module", "s_q", "s_kv", "d_qk", "num_heads", "batch", "mQ", "mKV",
                             "mOut", "mdO", "mLSE", "mAttnSink", "mTopkIdxs", "mTopkLength",
                             "mdQ", "mdKV", "mdSink", "mWorkspaceLSE", "mWorkspaceDKV",
                             "sm_scale", "stream"],
            "problem_shape": "s_q = S_q, s_kv = S_kv, d_qk and num_heads = the variant's, batch 1",
            "tensors": "flat tokens, row-major: q/dq [S_q, H, D_qk], kv/dkv [S_kv, D_qk], "
                       "out/dout [S_q, H, 512] bf16; lse [S_q, H] fp32 natural-log sink-free, "
                       "8-byte aligned; attn_sink/d_sink [H] fp32; indices [S_q, K] int32 global "
                       "rows, valid prefix then -1; topk_length [S_q] int32",
            "launches": "one call launches clear dKV, sum O.dO, backward, convert dKV, sum dSink",
            "addressing": "32-bit: every tensor below 2^31 elements (the frontend switches to "
                          "another artifact beyond that; not exported)",
        },
        "workspace": workspace_section(),
        "artifacts": entries,
        "not_exported": [
            {"heads": h, "d_qk": d, "slot_bucket": k, "frontend_backend": b,
             "why": "the frontend runs its two-CTA class here, not the generic one"}
            for h, d, k, b in skipped()],
    }
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


def write_link_check(out_dir: str, jobs) -> None:
    """A C++ program referencing every artifact: linking it proves the objects are complete."""
    lines = ["// Generated by ffi/cuda/export/export_dsa_bwd_sm100.py: never run, only linked."]
    lines += [f'#include "{prefix(*j)}.h"' for j in jobs]
    lines += ["", "int main() {", "  const void* fns[] = {"]
    for j in jobs:
        p = prefix(*j)
        lines.append(f"      reinterpret_cast<const void*>(&cute_dsl_{p}_wrapper),")
        lines.append(f"      reinterpret_cast<const void*>(&{p}_Kernel_Module_Load),")
    lines += ["  };", "  return fns[0] == nullptr;", "}", ""]
    with open(os.path.join(out_dir, "dsa_bwd_sm100_link_check.cc"), "w") as f:
        f.write("\n".join(lines))


def outputs():
    names = [MANIFEST, "dsa_bwd_sm100_link_check.cc"]
    for j in variants():
        names += [prefix(*j) + ".o", prefix(*j) + ".h"]
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--list-outputs", action="store_true",
                    help="print the files the export writes (one per line) and exit")
    ap.add_argument("--spec-stamp", metavar="FILE",
                    help="write the kernel_spec values the export reads to FILE (only if they "
                         "changed) and exit")
    args = ap.parse_args()
    if args.spec_stamp:
        kernel_spec_loader.write_stamp(args.spec_stamp, SPEC)
        return
    if args.list_outputs:
        print("\n".join(outputs()))
        return
    if not args.out_dir:
        ap.error("--out-dir is required")
    os.makedirs(args.out_dir, exist_ok=True)
    jobs = variants()
    t0 = time.time()
    work = [(*j, args.out_dir) for j in jobs]
    entries = []
    ctx = __import__("multiprocessing").get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        for entry, seconds in pool.map(_job, work):
            print(f"export_dsa_bwd_sm100: {entry['object']} ({seconds:.1f} s)", flush=True)
            entries.append(entry)
    write_manifest(args.out_dir, entries)
    write_link_check(args.out_dir, jobs)
    print(f"export_dsa_bwd_sm100: {len(jobs)} kernels for {', '.join(ARCHS)} "
          f"in {time.time() - t0:.0f} s (compile-only)")


if __name__ == "__main__":
    main()
