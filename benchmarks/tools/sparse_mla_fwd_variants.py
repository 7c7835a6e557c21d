"""Same-process comparison of builds of the SM90 sparse MLA forward (how kernel changes are ranked).

Each build is a library from ``benchmarks/tools/build_fwd_variant.sh``
(``build/fwd_variants/NAME/libfwd.so``); ``NAME@k`` loads a byte copy of NAME under another file
name, whose spread against NAME shows the noise of the call. Every build (not the copies) first
runs a float64 accuracy list (below: a build is not the installed kernel that
tests/test_ops_sparse_mla_cuda.py checks); then, shape by shape, every build and a bf16 8192^3
matmul are timed back to back for the same wall time each, in rounds of changing order, so that
all run in the same power state (the H200 holds its power cap under each; see ``steady_many`` in
benchmarks/ops/sparse_mla_fwd.py). Reported: median TFLOP/s of each, its fraction of the matmul,
its change against the first build, and the SM clock and power seen meanwhile.

    python benchmarks/tools/sparse_mla_fwd_variants.py [--out [FILE]] main main@1 change1 change2
        [--rounds N] [--seconds 0.4] [--shapes abc] [--skip-accuracy] [--l2-persisting MiB|max]
        [--hang-s 300]

(build/ is git-ignored: a remote GPU machine needs build/fwd_variants sent with the checkout.)

A build that hangs (a kernel that never finishes) would hold the GPU machine to its time limit and
return nothing: each build's accuracy list (where a build first runs) and the timing run under a
watchdog that prints where the process stood and exits (rc 1, nothing written to ``--out``) after
``--hang-s`` seconds; the timing's limit is twice its planned wall time plus ``--hang-s``.

``--l2-persisting`` sets the CUDA limit cudaLimitPersistingL2CacheSize (the share of the L2 that
lines marked evict_last, such as the kernel's kv rows, may keep) for the whole process first (needs
CuPy); without it the limit stays as the process found it, and both values are stored.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import math
import os
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

sys.path.insert(0, str(common.ROOT / "tests"))  # the tests' float64 oracle

import numpy as np  # noqa: E402
import torch  # noqa: E402

import oracle  # noqa: E402  (the float64 references of the tests)
from benchmarks.ops import sparse_mla_fwd as bench  # noqa: E402

_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
_ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize


D_V = bench.D_V


def check_case(kern, name, case, sm_scale, results, max_ctas=0, sample=0, gen=None):
    """One case, launched twice into NaN-poisoned outputs: every output written, the two launches
    bit-identical, and out / lse / max_logits against the float64 reference: on every row, or with
    ``sample`` (the full-size shapes) on the first, middle and last 12 rows and ``sample`` random
    ones."""
    q, kv, idx, length, sink = case
    s_q, h, d = q.shape
    outs = []
    for _ in range(2):
        out = torch.full((s_q, h, D_V), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((s_q, h), float("nan"), device="cuda")
        mx = torch.full((s_q, h), float("nan"), device="cuda")
        kern.run(q, kv, idx, length, sink, out, lse, mx, sm_scale, max_ctas=max_ctas)
        outs.append((out, lse, mx))
    (out, lse, mx), (out2, lse2, mx2) = outs
    deterministic = bool(torch.equal(out.view(torch.int16), out2.view(torch.int16))
                         and torch.equal(lse.view(torch.int32), lse2.view(torch.int32))
                         and torch.equal(mx.view(torch.int32), mx2.view(torch.int32)))
    written = bool(not out.isnan().any() and not lse.isnan().any() and not mx.isnan().any())
    rows = torch.arange(s_q)
    if sample:
        # the first rows hold make_case's duplicates and zero topk_length and land in the CTAs'
        # first tiles, the last ones in their last tiles (the output stored after the loop)
        ends = torch.arange(12)
        rows = torch.cat([ends, s_q // 2 - 6 + ends, s_q - 12 + ends,
                          torch.randperm(s_q, generator=gen)[:sample]]).unique()
    rows = rows.cuda()
    ro, rl, _, _, _, rm = oracle.sparse_mla(
        q[rows].double().cpu().numpy(), kv.double().cpu().numpy(), idx[rows].cpu().numpy(),
        sm_scale, D_V, sink.double().cpu().numpy(), length[rows].cpu().numpy())
    o = out[rows].double().cpu().numpy()
    l = lse[rows].double().cpu().numpy()
    m = mx[rows].double().cpu().numpy()
    rel = float(np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30))
    fin = np.isfinite(rl)
    lse_err = float(np.abs(l[fin] - rl[fin]).max()) if fin.any() else 0.0
    mx_err = float(np.abs(m[fin] - rm[fin]).max()) if fin.any() else 0.0
    empty = ~fin
    empty_ok = bool(np.all(np.isposinf(l[empty])) and np.all(np.isneginf(m[empty]))
                    and np.all(o[empty] == 0) and np.array_equal(np.isfinite(l), fin))
    ok = written and deterministic and empty_ok and rel <= 3e-3 and lse_err <= 1e-4 and mx_err <= 1e-4
    r = dict(case=name, s_q=s_q, s_kv=kv.shape[0], h=h, d_qk=d, k=idx.shape[1],
             reference_rows=int(rows.numel()), out_rel_l2=rel,
             lse_max_abs=lse_err, max_logits_max_abs=mx_err, empty_rows=int(empty.sum() // 1),
             all_written=written, deterministic=deterministic, empty_rows_ok=empty_ok, passed=ok)
    results.append(r)
    print(f"{'PASS' if ok else 'FAIL'} {name}: out rel L2 {rel:.2e}, lse {lse_err:.2e}, "
          f"max_logits {mx_err:.2e}, empty {int(empty.sum())} (ok {empty_ok}), written {written}, "
          f"deterministic {deterministic}", flush=True)
    return ok


# The accuracy list (fresh random inputs each run); "ctas" caps the persistent grid so that each
# CTA walks many tiles of varied lengths.
ACCURACY_CASES = [
    ("H64 D576 K128 sink lengths", dict(s_q=67, s_kv=500, h=64, d=576, k=128, empty_rows=(5,), lengths=True)),
    ("H128 D576 K2048 S_kv<K no-sink", dict(s_q=33, s_kv=1000, h=128, d=576, k=2048, empty_rows=(6,), sink="-inf")),
    ("H64 D512 K640 sink lengths", dict(s_q=70, s_kv=3000, h=64, d=512, k=640, empty_rows=(5, 9), lengths=True)),
    ("H128 D512 K256 mixed sinks", dict(s_q=65, s_kv=200, h=128, d=512, k=256, empty_rows=(7,), sink="mixed")),
    ("H64 D576 K2048 all valid", dict(s_q=20, s_kv=70000, h=64, d=576, k=2048, all_valid=True, sink="-inf")),
    ("H128 D576 K192 S_kv 32 lengths", dict(s_q=129, s_kv=32, h=128, d=576, k=192, lengths=True)),
    ("H64 D576 K640 lengths, 5 CTAs", dict(s_q=150, s_kv=3000, h=64, d=576, k=640, empty_rows=(5, 17, 18), lengths=True, ctas=5)),
    ("H128 D512 K256 mixed sinks lengths, 7 CTAs", dict(s_q=65, s_kv=900, h=128, d=512, k=256, empty_rows=(7, 8), sink="mixed", lengths=True, ctas=7)),
    ("H64 D512 K128 lengths, 3 CTAs", dict(s_q=97, s_kv=300, h=64, d=512, k=128, empty_rows=(3,), lengths=True, ctas=3)),
    ("H64 D576 K1024 lengths, 600 rows", dict(s_q=600, s_kv=5000, h=64, d=576, k=1024, empty_rows=(9,), lengths=True)),
    # issue 7's shapes at full size (every CTA walks many tiles); the reference on ~80 rows
    *((f"({n}) full size, rows sampled",
       dict(kw, empty_rows=(11, kw["s_q"] // 2, kw["s_q"] - 1), lengths=True, sample=48))
      for n, kw in bench.SHAPES),
]


def accuracy_list(kern, results, label=""):
    """ACCURACY_CASES on fresh random inputs against the float64 reference; returns (all passed,
    the first case's inputs)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ok = True
    first = None
    for name, kw in ACCURACY_CASES:
        kw = dict(kw)
        ctas = kw.pop("ctas", 0)
        sample = kw.pop("sample", 0)
        case = bench.make_case(gen, **kw)
        first = first or case
        ok &= check_case(kern, label + name, case, 1.0 / math.sqrt(kw["d"]) * 1.3, results, ctas,
                         sample, gen)
        del case
    return ok, first


def load_builds(names, tmp):
    root = str(common.ROOT / "build" / "fwd_variants")
    kerns, md5 = {}, {}
    for n in names:
        base = n.split("@")[0]
        if base == "matmul":
            raise SystemExit("sparse_mla_fwd_variants: 'matmul' names the reference, not a build")
        path = os.path.join(root, base, "libfwd.so")
        if not os.path.exists(path):
            raise SystemExit(f"sparse_mla_fwd_variants: {path} missing: run "
                             f"benchmarks/tools/build_fwd_variant.sh {base}")
        if "@" in n:  # a second file: the dynamic loader would hand back the same library
            copy = os.path.join(tmp, n.replace("@", "_") + ".so")
            shutil.copy(path, copy)
            path = copy
        kerns[n] = bench.Kernel(path)
        with open(os.path.join(root, base, "md5.txt")) as f:
            md5[n] = f.read().split()
    return kerns, md5


def watchdog(seconds, what):
    """Exits the process (after a traceback of every thread) if it is still at `what` after
    `seconds`; cancelled with faulthandler.cancel_dump_traceback_later()."""
    print(f"{what} (watchdog {seconds:.0f} s)", flush=True)
    faulthandler.dump_traceback_later(seconds, exit=True)


def accuracy(kern, name, hang_s):
    rows = []
    watchdog(hang_s, f"accuracy list: {name}")
    ok, _ = accuracy_list(kern, rows, label=f"{name}: ")
    faulthandler.cancel_dump_traceback_later()
    return dict(passed=bool(ok), out_rel_l2_max=max(r["out_rel_l2"] for r in rows),
                lse_max_abs=max(r["lse_max_abs"] for r in rows),
                max_logits_max_abs=max(r["max_logits_max_abs"] for r in rows))


def set_persisting_l2(value):
    """Returns (limit found, limit in force) in bytes; value None leaves it."""
    try:
        import cupy
    except ImportError:
        if value is None:
            return None, None
        raise SystemExit("sparse_mla_fwd_variants: --l2-persisting needs CuPy")
    rt = cupy.cuda.runtime
    found = rt.deviceGetLimit(_LIMIT_PERSISTING_L2)
    if value is not None:
        top = rt.deviceGetAttribute(_ATTR_MAX_PERSISTING_L2, torch.cuda.current_device())
        rt.deviceSetLimit(_LIMIT_PERSISTING_L2, top if value == "max" else int(value) << 20)
    return found, rt.deviceGetLimit(_LIMIT_PERSISTING_L2)


def report(row):
    base = next(iter(row["builds"].values()))["tflops"]
    print(f"({row['shape']}) matmul {row['matmul_tflops']:.0f} TFLOP/s | " + " | ".join(
        f"{n} {v['tflops']:.0f} {v['fraction_of_matmul']:.3f} "
        f"{100 * (v['tflops'] / base - 1):+.1f}% "
        f"@{v['power'].get('sm_clock_mhz_median', float('nan')):.0f} MHz"
        for n, v in row["builds"].items()), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="NAME or NAME@k (a copy); the first is the control")
    ap.add_argument("--rounds", type=int, default=0, help="default: twice (builds + 1)")
    ap.add_argument("--seconds", type=float, default=0.4, help="wall time of each timed phase")
    ap.add_argument("--shapes", default="abc", help="which of issue 7's shapes (a, b, c)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--l2-persisting", help="MiB, or max: set cudaLimitPersistingL2CacheSize")
    ap.add_argument("--hang-s", type=float, default=300,
                    help="watchdog: seconds allowed for one build's accuracy list, and added to "
                         "twice the timing's planned wall time")
    common.add_result_args(ap)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kerns, md5 = load_builds(args.builds, tmp)
        found, limit = set_persisting_l2(args.l2_persisting)
        res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   gpu=torch.cuda.get_device_name(), commit=common.commit(args.commit),
                   builds=args.builds, kernel_object_md5=md5,
                   l2_persisting_limit_found=found, l2_persisting_limit=limit)
        if found is not None:
            print(f"persisting L2 limit {found / 2**20:.2f} MiB -> {limit / 2**20:.2f} MiB")
        if not args.skip_accuracy:
            res["accuracy"] = {n: accuracy(k, n, args.hang_s) for n, k in kerns.items()
                               if "@" not in n}
            for n, a in res["accuracy"].items():
                print(f"{'PASS' if a['passed'] else 'FAIL'} {n}: {a}", flush=True)
        shapes = [s for s in bench.SHAPES if s[0] in args.shapes]
        # each rotation of the phase order once forward and once reversed (see steady_many)
        rounds = args.rounds or 2 * (len(kerns) + 1)
        planned = len(shapes) * rounds * (len(kerns) + 1) * args.seconds
        watchdog(args.hang_s + 2 * planned, "timing")
        res["steady"] = bench.steady_many(kerns, shapes, args.seconds, rounds, report=report)
        faulthandler.cancel_dump_traceback_later()
    common.write_json(common.out_path(args.out, __file__, devices=bench.torch_devices()), res)
    if not all(a["passed"] for a in res.get("accuracy", {}).values()):
        raise SystemExit("sparse_mla_fwd_variants: a build failed the accuracy list")


if __name__ == "__main__":
    main()
