"""Forward+backward of ``sparse_mla`` under ``jax.jit``: one implementation against another.

    python benchmarks/ops/sparse_mla_fwd_bwd.py --implementations cuda xla --repeats 50 --out

For each shape and implementation: median wall time of a jitted ``jax.grad`` (forward, then
backward with respect to q and kv) over ``--repeats`` runs after a warm-up, and the compiled
program's peak memory (arguments + outputs + temporaries, from XLA's memory analysis). bf16 inputs,
every slot valid (random distinct-ish rows), no sink unless the shape has one. FLOPs counted as
forward 2·H·(D_qk+D_v)·S_q·K plus backward 10·H·D_qk·S_q·K (FlashMLA's and the cuDNN frontend's
counts).
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_dsa import sparse_mla  # noqa: E402

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

    # Every array is an argument of the jitted function (closed over, the slot list would be a
    # constant XLA folds: a long first call that a training step never pays).
    def loss(q, kv, idx, sink):
        out, _ = sparse_mla(q, kv, idx, sm_scale=d**-0.5, d_v=512, attn_sink=sink,
                            implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (q, kv, idx, sink)
    mem = step.lower(*args).compile().memory_analysis()
    jax.block_until_ready(step(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args))
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
    common.add_result_args(p)
    a = p.parse_args()
    rows = []
    for name in a.shapes:
        for impl in a.implementations:
            r = {"shape": name, **SHAPES[name], **measure(SHAPES[name], impl, a.repeats)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    common.write_json(common.out_path(a.out, __file__), {
        "benchmark": "benchmarks/ops/sparse_mla_fwd_bwd.py: sparse_mla fwd+bwd under jax.jit",
        "date": common.today(), "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
        "commit": common.commit(a.commit), "timing": "median wall time of a jitted call",
        "rows": rows})


if __name__ == "__main__":
    main()
