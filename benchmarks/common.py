"""What the benchmark scripts share: the repository on ``sys.path``, the commit and the file name a
result gets, and the GPU time of a jitted call from a profiler trace.

A script under ``benchmarks/<level>/`` starts with

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
    from benchmarks import common  # noqa: E402

and runs from the repository root (``python benchmarks/ops/x.py``). Importing this module puts the
repository root and ``examples/`` on ``sys.path`` (for ``benchmarks.*`` and ``text_data``).

Results: ``--out`` alone writes ``benchmarks/results/<script>_<gpu>[_<tag>].json`` (``<gpu>``:
``h200``, ``h100``, ``h200x2`` for a run over two GPUs, ``cpu``), ``--out FILE`` writes FILE;
``benchmarks/results/`` keeps the latest result of each, with its commit and date inside.
"""

from __future__ import annotations

import collections
import datetime
import glob
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
for _p in (ROOT / "examples", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# The code a result measures: a change here outside the results marks the commit "+dirty".
_CODE = ("jax_dsa", "ffi", "benchmarks", "CMakeLists.txt", "pyproject.toml",
         ":(exclude)benchmarks/results")


def commit(given: str | None = None) -> str:
    """``given`` (``--commit``, for a copy of the tree whose git metadata is stale), else the
    checkout's short HEAD, with ``+dirty`` when the measured code differs from it; ``unknown``
    without git."""
    if given:
        return given
    try:
        git = dict(cwd=ROOT, capture_output=True, text=True, check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                *_CODE], **git).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def today() -> str:
    return datetime.date.today().isoformat()


def gpu_tag(devices=None) -> str:
    """``h200``, ``h100``, ... from the device kind (``cpu`` on the host), ``x<n>`` added when
    ``devices`` (default: the first device only) holds more than one."""
    if devices is None:
        import jax

        devices = jax.devices()[:1]
    kind = devices[0].device_kind
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", kind)
    tag = m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "", kind.lower()) or "unknown"
    return tag + (f"x{len(devices)}" if len(devices) > 1 else "")


def result_path(script: str, tag: str | None = None, devices=None) -> pathlib.Path:
    """``benchmarks/results/<script>_<gpu>[_<tag>].json`` for the script file ``script``."""
    stem = pathlib.Path(script).stem
    return RESULTS / f"{stem}_{gpu_tag(devices)}{'_' + tag if tag else ''}.json"


def add_result_args(parser, tag_help: str | None = None) -> None:
    """``--out [FILE]`` and ``--commit``."""
    where = "benchmarks/results/<script>_<gpu>" + ("_<tag>" if tag_help else "") + ".json"
    parser.add_argument("--out", nargs="?", const="", default=None, metavar="FILE",
                        help=f"write the result as JSON to FILE; --out alone: {where}"
                        + (f" ({tag_help})" if tag_help else ""))
    parser.add_argument("--commit", default=None,
                        help="the commit to record (default: git's HEAD, +dirty where the code "
                        "differs from it)")


def out_path(out: str | None, script: str, tag: str | None = None, devices=None):
    """Where ``--out`` asks the result to go: None (nowhere), FILE, or :func:`result_path`."""
    if out is None:
        return None
    return pathlib.Path(out) if out else result_path(script, tag, devices)


def write_json(path, obj) -> None:
    """Writes ``obj`` as indented JSON to ``path`` (parents made), if ``path`` is not None."""
    if path is None:
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
    print("wrote", path, flush=True)


def kernel_times(step, args, steps: int, top: int) -> dict:
    """Per-kernel GPU time of ``step(*args)`` averaged over ``steps`` traced runs: each kernel's
    duration on the device from a JAX profiler trace, summed per kernel name. The device-side
    counterpart of a host wall time (no launch or synchronisation latency), comparable to
    CUDA-event timings such as ``triton.testing.do_bench``. Meant for GPUs."""
    import jax

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


def matmul_tflops(n: int = 8192, chain: int = 10, reps: int = 10) -> float:
    """TFLOP/s of bf16 ``n^3`` ``jnp.dot`` in this process: the median over ``reps`` of one jitted
    call that runs ``chain`` dependent matmuls back to back, so the host's launch and
    synchronisation latency (tens of microseconds against a ~1.5 ms matmul) is paid once per
    ``chain``. The same-run reference for the benchmarks' ratios."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) * (1.0 / n**0.5)
    f = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda _, c: c @ b, a))
    for _ in range(2):
        jax.block_until_ready(f(a, b))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 * chain / times[len(times) // 2] / 1e12
