"""Peak memory of the "xla" sparse_mla forward+backward, from the compiled program's memory analysis.

Nothing is run: each shape is lowered and compiled for the local backend and XLA's buffer assignment
is read back. Shows that memory grows linearly in the sequence length (no [S_q, K, D_qk] gather, no
[S_q, H, S_kv] scores).

    .venv/bin/python benchmarks/ops/memory_sparse_mla.py [--out [FILE]]
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_dsa import sparse_mla  # noqa: E402


def analyse(s, h, d_qk, d_v, topk, dtype):
    q = jax.ShapeDtypeStruct((s, h, d_qk), dtype)
    kv = jax.ShapeDtypeStruct((s, d_qk), dtype)
    idx = jax.ShapeDtypeStruct((s, topk), jnp.int32)

    def fwd_bwd(q, kv, idx):
        def loss(q, kv):
            out, _ = sparse_mla(q, kv, idx, sm_scale=d_qk**-0.5, d_v=d_v, implementation="xla")
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, (0, 1))(q, kv)

    m = jax.jit(fwd_bwd).lower(q, kv, idx).compile().memory_analysis()
    io = m.argument_size_in_bytes + m.output_size_in_bytes
    return {
        "s_q": s, "s_kv": s, "h": h, "d_qk": d_qk, "d_v": d_v, "topk": topk,
        "dtype": jnp.dtype(dtype).name,
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "peak_bytes": io + m.temp_size_in_bytes - m.alias_size_in_bytes,
        "whole_sequence_gather_bytes": s * topk * d_qk * 4,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--d-qk", type=int, default=576)
    p.add_argument("--d-v", type=int, default=512)
    p.add_argument("--topk", type=int, default=2048)
    common.add_result_args(p)
    a = p.parse_args()
    rows = [analyse(s, a.heads, a.d_qk, a.d_v, a.topk, jnp.bfloat16) for s in a.seq]
    print(f"{'S':>7} {'peak MiB':>10} {'temp MiB':>10} {'peak/S (KiB)':>13} {'gather-all MiB':>15}")
    for r in rows:
        print(f"{r['s_q']:>7} {r['peak_bytes']/2**20:>10.1f} {r['temp_bytes']/2**20:>10.1f} "
              f"{r['peak_bytes']/r['s_q']/1024:>13.2f} {r['whole_sequence_gather_bytes']/2**20:>15.0f}")
    common.write_json(common.out_path(a.out, __file__), {
        "benchmark": "benchmarks/ops/memory_sparse_mla.py: sparse_mla xla fwd+bwd compiled memory",
        "date": common.today(),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "commit": common.commit(a.commit),
        "rows": rows,
    })


if __name__ == "__main__":
    main()
