"""Speed of jax_dsa's own SM90 sparse MLA forward (FlashMLA v2 contract).

Run on an SM90 GPU with jax_dsa's CUDA module built and PyTorch installed (torch only allocates
and times here; the kernel is launched from raw pointers through the ctypes entry
``jax_dsa_sparse_mla_fwd_raw_bench`` of the benchmark library ``jax_dsa/libjax_dsa_cuda_bench.so``,
built with the module unless ``JAX_DSA_CUDA_BENCH=OFF``, and once through XLA FFI via
``jax.ffi.ffi_call``).

    python benchmarks/ops/sparse_mla_fwd.py [--out [FILE]] [--skip-speed]
                                            [--k-sweep] [--kv-sweep] [--steady]
    python benchmarks/ops/sparse_mla_fwd.py --sanitize   # one tiny launch (compute-sanitizer)

Its accuracy against float64 is tests/test_ops_sparse_mla_cuda.py (``make test-gpu``); a build
of ``benchmarks/tools/build_fwd_variant.sh`` is checked by
``benchmarks/tools/sparse_mla_fwd_variants.py`` before it is timed.
Speed: CUDA-event median over >= 50 launches at the issue's three shapes, all slots valid, and a
bf16 8192^3 torch matmul timed in the same process; FLOPs = 2 H (D_qk + 512) S_q K.
``--steady`` also compares the two in the same power state: the H200 holds its 700 W cap under
both, at different SM clocks, so a short matmul burst on a cool card overstates the ceiling
(see ``steady``).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import math
import pathlib
import subprocess
import sys
import threading
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

D_V = 512
# issue 7's three shapes: (a) S_q 4096 / S_kv 32768 H 128, (b) GLM-5 training, (c) V4 with a sink
SHAPES = [
    ("a", dict(s_q=4096, s_kv=32768, h=128, d=576, k=2048, sink="-inf")),
    ("b", dict(s_q=16384, s_kv=16384, h=64, d=576, k=2048, sink="-inf")),
    ("c", dict(s_q=16384, s_kv=16384, h=64, d=512, k=640, sink="finite")),
]


def library_path():
    """The benchmark library installed next to jax_dsa's CUDA module."""
    from jax_dsa import _native

    try:
        return _native.bench_library()
    except (NotImplementedError, FileNotFoundError) as e:
        raise SystemExit(f"sparse_mla_fwd: {e}") from e


class Kernel:
    """The forward's raw bench entry in jax_dsa's benchmark library, or in another build of it
    (path: a shared library from ``benchmarks/tools/build_fwd_variant.sh``)."""

    def __init__(self, path=None):
        self.lib = ctypes.CDLL(path or library_path())
        f = self.lib.jax_dsa_sparse_mla_fwd_raw_bench
        f.restype = ctypes.c_int
        P, I = ctypes.c_void_p, ctypes.c_int
        f.argtypes = [P, P, P, P, P, P, P, P, I, I, I, I, I, ctypes.c_float, I, I, P]
        self.f = f

    def run(self, q, kv, idx, length, sink, out, lse, mx, sm_scale, iters=1, max_ctas=0):
        """max_ctas > 0 caps the persistent grid (so that each CTA walks many tiles)."""
        s_q, h, d = q.shape
        ms = np.zeros(iters, np.float32)
        # the entry launches on a private non-blocking stream, which does not wait for torch's
        # stream: the inputs and the poisoned outputs must be written before it starts
        torch.cuda.synchronize()
        rc = self.f(q.data_ptr(), kv.data_ptr(), idx.data_ptr(), length.data_ptr(), sink.data_ptr(),
                    out.data_ptr(), lse.data_ptr(), mx.data_ptr(), s_q, kv.shape[0], h, d,
                    idx.shape[1], sm_scale, iters, max_ctas, ms.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"kernel launch failed: rc {rc}")
        torch.cuda.synchronize()
        return ms


def make_case(gen, s_q, s_kv, h, d, k, *, invalid=0.15, empty_rows=(), dup=True, lengths=False,
              sink="finite", all_valid=False):
    dev = "cuda"
    q = (torch.randn(s_q, h, d, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    kv = torch.randn(s_kv, d, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.randint(0, s_kv, (s_q, k), generator=gen, dtype=torch.int32)
    if not all_valid:
        u = torch.rand(s_q, k, generator=gen)
        idx = torch.where(u < invalid, torch.full_like(idx, -1), idx)
        far = torch.tensor([s_kv, s_kv + 7, 2**31 - 1, -(2**31)], dtype=torch.int32)
        pick = far[torch.randint(0, 4, (s_q, k), generator=gen)]
        idx = torch.where((u >= invalid) & (u < invalid + 0.03), pick, idx)
        for r in empty_rows:
            if r < s_q:
                idx[r] = -1
        if dup and s_q > 3:
            idx[2] = idx[3]  # identical rows
            idx[1, : k // 2] = idx[1, 0]  # one kv row many times in one query
    if lengths:
        length = torch.randint(0, k + 1, (s_q,), generator=gen, dtype=torch.int32)
        length[0] = k
        if s_q > 4:
            length[4] = 0
    else:
        length = torch.full((s_q,), k, dtype=torch.int32)
    if sink == "finite":
        att = torch.randn(h, generator=gen) * 1.5
    elif sink == "-inf":
        att = torch.full((h,), -math.inf)
    else:  # mixed finite, -inf and +inf
        att = torch.randn(h, generator=gen) * 1.5
        att[::3] = -math.inf
        att[1] = math.inf
    return q, kv, idx.to(dev), length.to(dev), att.float().to(dev)


def time_case(kern, gen, iters, *, s_q, s_kv, h, d, k, sink, window=False):
    """Median CUDA-event time of one shape, all slots valid (random rows, or with ``window`` a
    run of consecutive rows per query), after 5 warm-up launches."""
    q, kv, idx, length, att = make_case(gen, s_q=s_q, s_kv=s_kv, h=h, d=d, k=k, all_valid=True,
                                        sink=sink)
    if window:
        start = torch.randint(0, s_kv - k + 1, (s_q, 1), generator=gen, dtype=torch.int32)
        idx = (start + torch.arange(k, dtype=torch.int32)[None]).cuda()
    out = torch.empty((s_q, h, D_V), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((s_q, h), device="cuda")
    mx = torch.empty((s_q, h), device="cuda")
    kern.run(q, kv, idx, length, att, out, lse, mx, 0.1, iters=5)
    ms = kern.run(q, kv, idx, length, att, out, lse, mx, 0.1, iters=iters)
    med = float(np.median(ms))
    del q, kv, idx, out
    torch.cuda.empty_cache()
    return dict(s_q=s_q, s_kv=s_kv, h=h, d_qk=d, k=k, sink=sink != "-inf",
                indices="window" if window else "random", median_ms=med,
                min_ms=float(ms.min()), runs=iters,
                tflops=2 * h * (d + D_V) * s_q * k / (med * 1e-3) / 1e12)


def k_sweep(kern, iters):
    """Time against K at S_q = S_kv = 16384, H 64: the slope is the cost of a 64-slot block, the
    intercept the fixed cost of a (token, 64-head) tile (time x SMs / tiles)."""
    gen = torch.Generator().manual_seed(2)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    cases = [(d, k, False) for d in (576, 512) for k in (256, 640, 2048)]
    cases += [(576, 2048, True), (512, 640, True)]
    for d, k, window in cases:
        r = time_case(kern, gen, iters, s_q=16384, s_kv=16384, h=64, d=d, k=k, sink="-inf",
                      window=window)
        r["us_per_tile_slot"] = r["median_ms"] * 1e3 * sms / (r["s_q"] * r["h"] // 64)
        rows.append(r)
        print(f"D_qk {d} K {k} {r['indices']}: {r['median_ms']:.3f} ms, {r['tflops']:.0f} "
              f"TFLOP/s, {r['us_per_tile_slot']:.2f} us per tile", flush=True)
    return rows


def kv_sweep(kern, iters):
    """Time against S_kv (random rows from a longer and longer kv) at fixed S_q: where kv (S_kv x
    D_qk bf16) outgrows the L2, the gathered rows come from HBM."""
    gen = torch.Generator().manual_seed(6)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for h, d, k, s_q, sink in ((128, 576, 2048, 4096, "-inf"), (64, 576, 2048, 8192, "-inf"),
                               (64, 512, 640, 16384, "finite")):
        for s_kv in (8192, 32768, 131072, 524288):
            r = time_case(kern, gen, iters, s_q=s_q, s_kv=s_kv, h=h, d=d, k=k, sink=sink)
            r["kv_mb"] = s_kv * d * 2 / 1e6
            r["l2_mb"] = l2 / 1e6
            rows.append(r)
            print(f"H {h} D_qk {d} K {k} S_q {s_q} S_kv {s_kv} (kv {r['kv_mb']:.0f} MB, L2 "
                  f"{r['l2_mb']:.0f} MB): {r['median_ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s",
                  flush=True)
    return rows


def speed(kern, iters):
    rows = []
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def mm_tflops():
        for _ in range(5):
            torch.mm(a, b)
        ts = []
        for _ in range(iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.mm(a, b)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return 2 * 8192**3 / (float(np.median(ts)) * 1e-3) / 1e12

    mm_before = mm_tflops()
    for name, kw in SHAPES:
        rows.append(dict(shape=name, **time_case(kern, gen, iters, **kw)))
    mm_after = mm_tflops()
    mm = max(mm_before, mm_after)
    for r in rows:
        r["matmul_tflops"] = mm
        r["fraction_of_matmul"] = r["tflops"] / mm
    print(f"bf16 8192^3 matmul: {mm_before:.0f} TFLOP/s before, {mm_after:.0f} after")
    print("| shape | S_q | S_kv | H | D_qk | K | sink | median ms | TFLOP/s | / matmul |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['s_q']} | {r['s_kv']} | {r['h']} | {r['d_qk']} | {r['k']} | "
              f"{r['sink']} | {r['median_ms']:.3f} | {r['tflops']:.0f} | {r['fraction_of_matmul']:.3f} |")
    return rows, mm_before, mm_after


class ClockSampler:
    """nvidia-smi samples (SM clock MHz, power W) in a thread, tagged with the phase running."""

    def __init__(self):
        self.phase, self.samples, self._stop = None, [], False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop:
            phase = self.phase
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=10)
                clk, pw = (float(x) for x in out.stdout.strip().split(","))
                if phase is not None:
                    self.samples.append((phase, clk, pw))
            except (ValueError, OSError, subprocess.TimeoutExpired):
                pass
            time.sleep(0.05)

    def summary(self, phase):
        rows = [(c, p) for ph, c, p in self.samples if ph == phase]
        if not rows:
            return {}
        c, p = np.array(rows).T
        return dict(sm_clock_mhz_median=float(np.median(c)), power_w_median=float(np.median(p)),
                    samples=len(rows))

    def stop(self):
        self._stop = True
        self._thread.join(timeout=15)


def matmul_seq():
    """A function n -> the CUDA-event times (ms) of n bf16 8192^3 matmuls queued back to back."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def run(n):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            torch.mm(a, b)
            ev[i + 1].record()
        ev[-1].synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]

    return run


def steady_many(kerns, shapes=SHAPES, seconds=0.4, rounds=6, report=None):
    """Kernels (a dict name -> Kernel) against the matmul in the same power state: the card is
    power-capped (all run at its ~700 W limit and lose clock), so each is timed back to back for
    the same wall time, in rounds after a warm-up: the matmul first in the first round, each
    round in the reverse order of the one before, and with more than one kernel the starting
    point moving on every two rounds, so that no kernel always runs right after the same phase;
    medians of the per-launch CUDA-event times. The matmul's launches are queued without a host
    sync; the raw kernel entry syncs after each launch (a gap of some microseconds per 2.7-8 ms
    launch). The SM clock and power are nvidia-smi's readings during each phase (its power is a
    running average, so the phases' powers blur into each other). One row per shape (passed to
    report as it is done): the matmul's figures and, under "builds", each kernel's."""
    gen = torch.Generator().manual_seed(4)
    mm_seq = matmul_seq()
    sampler = ClockSampler()
    rows = []
    try:
        for shape, kw in shapes:
            q, kv, idx, length, att = make_case(gen, all_valid=True, **kw)
            out = torch.empty((kw["s_q"], kw["h"], D_V), dtype=torch.bfloat16, device="cuda")
            lse = torch.empty((kw["s_q"], kw["h"]), device="cuda")
            mx = torch.empty_like(lse)
            args = (q, kv, idx, length, att, out, lse, mx, 0.1)
            # five launches of each kernel to warm it up; the first kernel's set the phase length
            t_k = [float(np.median(kern.run(*args, iters=5))) for kern in kerns.values()]
            n_k = max(10, int(seconds * 1e3 / t_k[0]))
            n_mm = max(10, int(seconds * 1e3 / float(np.median(mm_seq(5)))))
            mm_seq(n_mm)  # warm-up into the power-capped state
            order = ["matmul"] + list(kerns)
            ms = {what: [] for what in order}
            for r in range(rounds):
                start = (r // 2) % len(order) if len(order) > 2 else 0
                seq = order[start:] + order[:start]
                for what in (seq if r % 2 == 0 else seq[::-1]):
                    sampler.phase = (what, shape)
                    ms[what] += (mm_seq(n_mm) if what == "matmul"
                                 else list(kerns[what].run(*args, iters=n_k)))
                sampler.phase = None
            time.sleep(0.2)
            fl = 2 * kw["h"] * (kw["d"] + D_V) * kw["s_q"] * kw["k"]
            mm_tf = 2 * 8192**3 / (np.median(ms["matmul"]) * 1e-3) / 1e12
            row = dict(shape=shape, s_q=kw["s_q"], s_kv=kw["s_kv"], h=kw["h"], d_qk=kw["d"],
                       k=kw["k"], sink=kw["sink"] != "-inf", matmul_runs=len(ms["matmul"]),
                       matmul_tflops=float(mm_tf), matmul_power=sampler.summary(("matmul", shape)),
                       builds={})
            for name in kerns:
                tf = fl / (np.median(ms[name]) * 1e-3) / 1e12
                row["builds"][name] = dict(median_ms=float(np.median(ms[name])),
                                           runs=len(ms[name]), tflops=float(tf),
                                           fraction_of_matmul=float(tf / mm_tf),
                                           power=sampler.summary((name, shape)))
            rows.append(row)
            if report:
                report(row)
            del args, q, kv, idx, out
            torch.cuda.empty_cache()
    finally:
        sampler.stop()
    return rows


def steady(kern, seconds=0.4, rounds=6):
    """This build's kernel against the matmul in the same power state (steady_many)."""

    def show(r):
        k = r["builds"]["kernel"]
        print(f"steady ({r['shape']}): kernel {k['median_ms']:.3f} ms {k['tflops']:.0f} TFLOP/s "
              f"({k['power']}), matmul {r['matmul_tflops']:.0f} TFLOP/s ({r['matmul_power']}): "
              f"{k['fraction_of_matmul']:.3f}", flush=True)

    rows = []
    for r in steady_many({"kernel": kern}, SHAPES, seconds, rounds, report=show):
        k = r.pop("builds")["kernel"]
        rows.append(dict(r, kernel_runs=k["runs"], kernel_median_ms=k["median_ms"],
                         kernel_tflops=k["tflops"], fraction_of_matmul=k["fraction_of_matmul"],
                         kernel_power=k["power"]))
    return rows


def torch_devices():
    """The GPU as :func:`benchmarks.common.gpu_tag` reads it (its ``device_kind``), from torch:
    naming the result starts no JAX GPU client next to torch's allocations."""
    return [types.SimpleNamespace(device_kind=torch.cuda.get_device_name())]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--k-sweep", action="store_true", help="also time against K (k_sweep)")
    ap.add_argument("--kv-sweep", action="store_true", help="also time against S_kv (kv_sweep)")
    ap.add_argument("--steady", action="store_true",
                    help="also time against the matmul in the same power state (steady)")
    ap.add_argument("--iters", type=int, default=60)
    common.add_result_args(ap)
    args = ap.parse_args()
    kern = Kernel()
    if args.profile:  # one launch of shape (b) at S_q 4096, for ncu (--launch-skip 1 --launch-count 1)
        gen = torch.Generator().manual_seed(5)
        q, kv, idx, length, sink = make_case(gen, s_q=4096, s_kv=16384, h=64, d=576, k=2048,
                                             all_valid=True, sink="-inf")
        out = torch.empty((4096, 64, D_V), dtype=torch.bfloat16, device="cuda")
        lse = torch.empty((4096, 64), device="cuda")
        mx = torch.empty_like(lse)
        kern.run(q, kv, idx, length, sink, out, lse, mx, 0.06, iters=2)
        return
    if args.sanitize:
        gen = torch.Generator().manual_seed(3)
        for kw in (dict(s_q=3, s_kv=100, h=64, d=576, k=128, lengths=True, empty_rows=(1,)),
                   dict(s_q=2, s_kv=50, h=128, d=512, k=192, sink="mixed"),
                   dict(s_q=2, s_kv=300, h=64, d=576, k=256, all_valid=True, sink="-inf"),
                   # two CTAs walking 5 and 4 tiles: the hand-over between tiles
                   dict(s_q=9, s_kv=200, h=64, d=512, k=256, lengths=True, empty_rows=(2,),
                        ctas=2)):
            ctas = kw.pop("ctas", 0)
            q, kv, idx, length, sink = make_case(gen, **kw)
            out = torch.empty((kw["s_q"], kw["h"], D_V), dtype=torch.bfloat16, device="cuda")
            lse = torch.empty((kw["s_q"], kw["h"]), device="cuda")
            mx = torch.empty_like(lse)
            kern.run(q, kv, idx, length, sink, out, lse, mx, 0.05, max_ctas=ctas)
        print("sanitize launches done")
        return
    res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               gpu=torch.cuda.get_device_name(), commit=common.commit(args.commit),
               driver=subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip(),
               torch=torch.__version__)
    if not args.skip_speed:
        rows, mb, ma = speed(kern, args.iters)
        res["speed"] = rows
        res["matmul_tflops_before_after"] = [mb, ma]
    if args.steady:
        res["steady"] = steady(kern)
    if args.k_sweep:
        res["k_sweep"] = k_sweep(kern, args.iters)
    if args.kv_sweep:
        res["kv_sweep"] = kv_sweep(kern, args.iters)
    common.write_json(common.out_path(args.out, __file__, devices=torch_devices()), res)


if __name__ == "__main__":
    main()
