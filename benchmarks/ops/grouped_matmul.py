"""Speed of the routed-experts mix on grouped_matmul: GLM-5's expert dims (hidden 6144,
moe_intermediate 2048), 16K tokens x top-8 = 131072 routed rows, random routing, bf16.

The mix, as the MoE layers run it (weights in the checkpoints' [E, out, in] layout,
``transpose_rhs``): gate = x Wgᵀ, up = x Wuᵀ, a = silu(gate) * up, y = a Wdᵀ; forward alone
(6·M·D·F FLOP) and forward+backward (18·M·D·F) in TFLOP/s, each as a fraction of the same
process's dense bf16 matmul (8192³, :func:`benchmarks.common.matmul_tflops`). ``--torch`` also
times ``torch._grouped_mm`` on the same shapes in a separate process (JAX holds the GPU's memory),
with its own 8192³ matmul (cuBLAS, CUDA events); each JAX row is then also given as a fraction of
that matmul, the stronger reference where it is faster. ``--tokamax`` also times tokamax's
``ragged_dot`` (``implementation="mosaic"``: its Pallas Mosaic-GPU kernels, compiled by XLA with
the step) in this process, with the weights in its own [E, in, out] layout. JAX rows: host
wall-clock medians of --runs after 3 warm-ups. Accuracy: tests/test_ops_grouped_matmul.py.

    python benchmarks/ops/grouped_matmul.py [--experts 8,64,256] [--impl cuda] [--torch]
        [--tokamax] [--out [FILE]]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa.ops.grouped_matmul import grouped_matmul  # noqa: E402

M, D, F = 131072, 6144, 2048


def median_ms(f, args, n, warm=3):
    for _ in range(warm):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def ours(impl):
    """jax_dsa's grouped_matmul on weights in the checkpoints' [E, out, in] layout."""
    return (lambda lhs, w, sizes: grouped_matmul(lhs, w, sizes, transpose_rhs=True,
                                                  implementation=impl)), True


def tokamax_mosaic():
    """tokamax's ragged_dot (Pallas Mosaic GPU) on weights in its [E, in, out] layout."""
    import tokamax

    return (lambda lhs, w, sizes: tokamax.ragged_dot(lhs, w, sizes,
                                                     implementation="mosaic")), False


def mix(dot):
    def run(x, wg, wu, wd, sizes):
        gate = dot(x, wg, sizes)
        up = dot(x, wu, sizes)
        a = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
        return dot(a, wd, sizes)

    def loss(x, wg, wu, wd, sizes, dy):
        return jnp.sum(run(x, wg, wu, wd, sizes).astype(jnp.float32) * dy)

    fwd = jax.jit(run)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return fwd, bwd


def jax_rows(experts, dot_and_layout, n_runs, dense):
    dot, out_in = dot_and_layout
    rows = []
    for e in experts:
        rng = np.random.default_rng(e)
        sizes = jnp.asarray(rng.multinomial(M, np.ones(e) / e), jnp.int32)
        k = jax.random.split(jax.random.key(e), 5)
        x = jax.random.normal(k[0], (M, D), jnp.bfloat16)
        up_shape, down_shape = ((e, F, D), (e, D, F)) if out_in else ((e, D, F), (e, F, D))
        wg, wu = (jax.random.normal(k[i], up_shape, jnp.bfloat16) * 0.02 for i in (1, 2))
        wd = jax.random.normal(k[3], down_shape, jnp.bfloat16) * 0.02
        dy = jax.random.normal(k[4], (M, D), jnp.float32)
        fwd, bwd = mix(dot)
        f_ms = median_ms(fwd, (x, wg, wu, wd, sizes), n_runs)
        b_ms = median_ms(bwd, (x, wg, wu, wd, sizes, dy), n_runs)
        f_tf, fb_tf = 6 * M * D * F / f_ms / 1e9, 18 * M * D * F / b_ms / 1e9
        rows.append({"experts": e, "fwd_ms": f_ms, "fwd_tflops": f_tf, "fwd_bwd_ms": b_ms,
                     "fwd_bwd_tflops": fb_tf, "fwd_bwd_vs_matmul": fb_tf / dense})
        print(json.dumps(rows[-1]), flush=True)  # as it comes: a run cut short keeps its rows
        del x, wg, wu, wd, dy
    return rows


TORCH = r"""
import json, sys, torch
M, D, F = 131072, 6144, 2048
def med(f, n):
    for _ in range(3): f()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]
n = int(sys.argv[1]); out = {}
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
out["matmul_tflops"] = 2 * 8192**3 / med(lambda: a @ b, n) / 1e9
del a, b
rows = []
for e in json.loads(sys.argv[2]):
    sizes = torch.distributions.Multinomial(M, torch.ones(e) / e).sample().to(torch.int32)
    offs = torch.cumsum(sizes, 0).to(torch.int32).cuda()
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wg, wu = (torch.randn(e, D, F, device="cuda", dtype=torch.bfloat16).mul_(0.02).requires_grad_() for _ in range(2))
    wd = torch.randn(e, F, D, device="cuda", dtype=torch.bfloat16).mul_(0.02).requires_grad_()
    dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    def run():
        gate = torch._grouped_mm(x, wg, offs=offs); up = torch._grouped_mm(x, wu, offs=offs)
        return torch._grouped_mm(torch.nn.functional.silu(gate) * up, wd, offs=offs)
    def both():
        torch.autograd.backward(run(), dy)
    with torch.no_grad():
        f_ms = med(run, n)
    b_ms = med(both, n)
    rows.append({"experts": e, "fwd_tflops": 6 * M * D * F / f_ms / 1e9,
                 "fwd_bwd_tflops": 18 * M * D * F / b_ms / 1e9,
                 "fwd_bwd_vs_matmul": 18 * M * D * F / b_ms / 1e9 / out["matmul_tflops"]})
    del x, wg, wu, wd, dy
    torch.cuda.empty_cache()
out["rows"] = rows
print(json.dumps(out))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", default="8,64,256")
    p.add_argument("--impl", default="cuda")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--torch", action="store_true", help="also time torch._grouped_mm")
    p.add_argument("--tokamax", action="store_true", help="also time tokamax.ragged_dot")
    common.add_result_args(p)
    args = p.parse_args()
    experts = [int(e) for e in args.experts.split(",")]
    result = {"date": common.today(), "commit": common.commit(args.commit),
              "gpu": jax.devices()[0].device_kind, "shape": {"rows": M, "hidden": D,
                                                              "moe_intermediate": F},
              "implementation": args.impl}
    if args.torch:  # first, before JAX takes the GPU's memory
        done = subprocess.run([sys.executable, "-c", TORCH, str(args.runs), str(experts)],
                              capture_output=True, text=True)
        result["torch_grouped_mm"] = (json.loads(done.stdout) if done.returncode == 0
                                      else {"error": done.stderr[-2000:]})
    result["matmul_tflops"] = dense = common.matmul_tflops()
    result["rows"] = jax_rows(experts, ours(args.impl), args.runs, dense)
    if args.tokamax:
        try:
            result["tokamax_mosaic"] = {"rows": jax_rows(experts, tokamax_mosaic(), args.runs,
                                                         dense)}
        except Exception as err:  # noqa: BLE001 - record why it could not run
            result["tokamax_mosaic"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
    print(f"same-process bf16 matmul 8192^3: {result['matmul_tflops']:.0f} TFLOP/s")
    torch_rows = {r["experts"]: r for r in result.get("torch_grouped_mm", {}).get("rows", [])}
    torch_mm = result.get("torch_grouped_mm", {}).get("matmul_tflops")
    if torch_mm:
        print(f"torch (cuBLAS) bf16 matmul 8192^3: {torch_mm:.0f} TFLOP/s")
        for r in result["rows"]:
            r["fwd_bwd_vs_torch_matmul"] = r["fwd_bwd_tflops"] / torch_mm
    tk_rows = {r["experts"]: r for r in result.get("tokamax_mosaic", {}).get("rows", [])}
    if "error" in result.get("tokamax_mosaic", {}):
        print("tokamax:", result["tokamax_mosaic"]["error"][:300])
    for r in result["rows"]:
        t = torch_rows.get(r["experts"], {})
        if r["experts"] in tk_rows:
            r["vs_tokamax"] = r["fwd_bwd_tflops"] / tk_rows[r["experts"]]["fwd_bwd_tflops"]
            print(f"E {r['experts']:4d}: tokamax mosaic fwd+bwd "
                  f"{tk_rows[r['experts']]['fwd_bwd_tflops']:.0f} TFLOP/s")
        print(f"E {r['experts']:4d}: fwd {r['fwd_tflops']:.0f}, fwd+bwd {r['fwd_bwd_tflops']:.0f} "
              f"TFLOP/s = {r['fwd_bwd_vs_matmul']:.2f}x matmul; torch._grouped_mm "
              f"{t.get('fwd_bwd_tflops', float('nan')):.0f} = "
              f"{t.get('fwd_bwd_vs_matmul', float('nan')):.2f}x")
    common.write_json(common.out_path(args.out, __file__), result)


if __name__ == "__main__":
    main()
