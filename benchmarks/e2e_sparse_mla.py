"""Forward+backward of ``sparse_mla`` under ``jax.jit``: one implementation against another.

    python benchmarks/e2e_sparse_mla.py --implementations cuda xla --out results.json

For each shape and implementation: median wall time of a jitted ``jax.grad`` (forward, then
backward with respect to q and kv) over ``--repeats`` runs after a warm-up, and the compiled
program's peak memory (arguments + outputs + temporaries, from XLA's memory analysis). bf16 inputs,
every slot valid (random distinct-ish rows), no sink unless the shape has one. FLOPs counted as
forward 2·H·(D_qk+D_v)·S_q·K plus backward 10·H·D_qk·S_q·K (FlashMLA's and the cuDNN frontend's
counts).
"""

import argparse
import datetime
import json
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

from jax_dsa import sparse_mla

SHAPES = {
    "glm5": dict(s=16384, h=64, d_qk=576, k=2048, sink=False),
    "deepseek-v4": dict(s=16384, h=64, d_qk=512, k=640, sink=True),
}


def measure(shape, implementation, repeats):
    s, h, d, k = shape["s"], shape["h"], shape["d_qk"], shape["k"]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (s, h, d), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (s, d), jnp.bfloat16)
    idx = jax.random.randint(keys[2], (s, k), 0, s, jnp.int32)
    sink = jax.random.normal(keys[3], (h,), jnp.float32) if shape["sink"] else None

    def loss(q, kv):
        out, _ = sparse_mla(q, kv, idx, sm_scale=d**-0.5, d_v=512, attn_sink=sink,
                            implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    mem = step.lower(q, kv).compile().memory_analysis()
    jax.block_until_ready(step(q, kv))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, kv))
        runs.append(time.perf_counter() - t0)
    median = statistics.median(runs)
    flop = 2 * h * (d + 512) * s * k + 10 * h * d * s * k
    return {
        "implementation": implementation, "median_ms": median * 1e3, "runs_ms": [r * 1e3 for r in runs],
        "tflops": flop / median / 1e12,
        "peak_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes
        + mem.temp_size_in_bytes - mem.alias_size_in_bytes,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--implementations", nargs="+", default=["cuda", "xla"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out")
    p.add_argument("--commit", help="commit of the build measured (default: this checkout's HEAD; "
                   "give it where the copy's git metadata is stale)")
    a = p.parse_args()
    rows = []
    for name in a.shapes:
        for impl in a.implementations:
            r = {"shape": name, **SHAPES[name], **measure(SHAPES[name], impl, a.repeats)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    if a.out:
        commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
        commit = commit or "unknown"
        with open(a.out, "w") as f:
            json.dump({"benchmark": "sparse_mla fwd+bwd under jax.jit",
                       "date": datetime.date.today().isoformat(),
                       "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "commit": commit, "timing": "median wall time of a jitted call",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
