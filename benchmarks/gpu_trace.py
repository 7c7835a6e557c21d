"""GPU time of a jitted call from a JAX profiler trace: every kernel's duration on the device,
summed per kernel name. The device-side counterpart of a host wall-time measurement (no launch
or synchronisation latency), comparable to CUDA-event timings such as ``triton.testing.do_bench``.
Meant for GPUs; used by ``step_profile.py`` and ``gpu_indexer_topk.py``.
"""

from __future__ import annotations

import collections
import glob
import tempfile
import time

import jax


def kernel_times(step, args, steps: int, top: int) -> dict:
    """Per-kernel GPU time of ``step(*args)`` averaged over ``steps`` traced runs."""
    for _ in range(2):
        jax.block_until_ready(step(*args))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(step(*args))
        wall = (time.perf_counter() - t0) / steps
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if not planes:
        raise RuntimeError("no GPU plane in the trace: " + ", ".join(p.name for p in data.planes))
    total, count = collections.Counter(), collections.Counter()
    for line in planes[0].lines:
        if not line.name.startswith("Stream"):  # kernels and copies; not the XLA op lines
            continue
        for ev in line.events:
            total[ev.name] += ev.duration_ns
            count[ev.name] += 1
    busy = sum(total.values())
    kernels = [{"name": name[:160], "ms": round(ns / steps / 1e6, 3),
                "launches": count[name] // steps, "share": round(ns / busy, 4)}
               for name, ns in total.most_common(top)]
    return {"wall_ms_traced": round(1e3 * wall, 3), "busy_ms": round(busy / steps / 1e6, 3),
            "kernels": kernels}
