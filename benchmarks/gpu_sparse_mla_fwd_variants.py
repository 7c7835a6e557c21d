"""Same-process comparison of builds of the SM90 sparse MLA forward (how kernel changes are ranked).

Each build is a library from ``build_fwd_variant.sh`` (``build/fwd_variants/NAME/libfwd.so``);
``NAME@k`` loads a byte copy of NAME under another file name, whose spread against NAME shows the
noise of the call. Every build (not the copies) first runs the float64 accuracy list of
``gpu_sparse_mla_fwd.py``; then, shape by shape, every build and a bf16 8192^3 matmul are timed
back to back for the same wall time each, in rounds of changing order, so that all run in the same
power state (the H200 holds its power cap under each; see ``gpu_sparse_mla_fwd.steady_many``).
Reported: median TFLOP/s of each, its fraction of the matmul, its change against the first build,
and the SM clock and power seen meanwhile.

    python benchmarks/gpu_sparse_mla_fwd_variants.py --out runs.json main main@1 change1 change2
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
import json
import os
import shutil
import tempfile

import torch

import gpu_sparse_mla_fwd as bench

_LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
_ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize


def load_builds(names, tmp):
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "fwd_variants")
    kerns, md5 = {}, {}
    for n in names:
        base = n.split("@")[0]
        if base == "matmul":
            raise SystemExit("gpu_sparse_mla_fwd_variants: 'matmul' names the reference, not a build")
        path = os.path.join(root, base, "libfwd.so")
        if not os.path.exists(path):
            raise SystemExit(f"gpu_sparse_mla_fwd_variants: {path} missing: run "
                             f"benchmarks/build_fwd_variant.sh {base}")
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
    ok, _ = bench.accuracy_list(kern, rows, label=f"{name}: ")
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
        raise SystemExit("gpu_sparse_mla_fwd_variants: --l2-persisting needs CuPy")
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
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=0, help="default: twice (builds + 1)")
    ap.add_argument("--seconds", type=float, default=0.4, help="wall time of each timed phase")
    ap.add_argument("--shapes", default="abc", help="which of issue 7's shapes (a, b, c)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--l2-persisting", help="MiB, or max: set cudaLimitPersistingL2CacheSize")
    ap.add_argument("--hang-s", type=float, default=300,
                    help="watchdog: seconds allowed for one build's accuracy list, and added to "
                         "twice the timing's planned wall time")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kerns, md5 = load_builds(args.builds, tmp)
        found, limit = set_persisting_l2(args.l2_persisting)
        res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   gpu=torch.cuda.get_device_name(), builds=args.builds, kernel_object_md5=md5,
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if not all(a["passed"] for a in res.get("accuracy", {}).values()):
        raise SystemExit("gpu_sparse_mla_fwd_variants: a build failed the accuracy list")


if __name__ == "__main__":
    main()
