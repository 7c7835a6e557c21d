"""``sparse_mla(implementation="cuda")`` differentiated inside a user's ``shard_map`` over the
GPUs (batch split, ``check_vma`` on): value and gradients against ``"xla"`` on one device.

A check on a machine with two or more GPUs (the CPU test suite covers the same path with the
host kernels). Prints and optionally writes JSON (``--out`` alone:
``benchmarks/results/shard_map_grad_<gpu>x<n>.json``):

    python benchmarks/tools/shard_map_grad.py [--out [FILE]] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_dsa import sparse_mla  # noqa: E402


def rel_l2(a, b):
    a, b = (jnp.asarray(x, jnp.float32).ravel() for x in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_result_args(ap)
    a = ap.parse_args()
    n = len(jax.devices())
    if n < 2:
        raise SystemExit("shard_map_grad: needs two or more devices")
    b, s, h, d, k = n, 512, 16, 576, 128  # H 16 is padded to 64 by the op
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((b, s, d)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-1, s, (b, s, k)), jnp.int32)  # some -1 slots
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, s, h, 512)), jnp.float32)

    def loss(impl):
        def f(q, kv, sink, idx, w):
            out, _ = sparse_mla(q, kv, idx, sm_scale=d ** -0.5, d_v=512, attn_sink=sink,
                                implementation=impl)
            return jnp.sum(out.astype(jnp.float32) * w)
        return f

    want = jax.jit(jax.value_and_grad(loss("xla"), argnums=(0, 1, 2)))(q, kv, sink, idx, w)

    def local(q, kv, sink, idx, w):
        v, g = jax.value_and_grad(loss("cuda"), argnums=(0, 1, 2))(q, kv, sink, idx, w)
        return jax.lax.psum(v, "dp"), g

    mesh = jax.make_mesh((n,), ("dp",))
    with jax.set_mesh(mesh):
        args = [x if x.ndim == 1 else jax.device_put(x, P("dp")) for x in (q, kv, sink, idx, w)]
        f = jax.jit(jax.shard_map(local, mesh=mesh,
                                  in_specs=(P("dp"), P("dp"), P(), P("dp"), P("dp")),
                                  out_specs=(P(), (P("dp"), P("dp"), P()))))
        hlo = f.lower(*args).as_text()
        got = f(*args)
    res = {
        "check": "sparse_mla cuda grad inside shard_map (check_vma) vs xla on one device",
        "date": common.today(), "gpu": jax.devices()[0].device_kind,
        "devices": n, "commit": common.commit(a.commit),
        "shape": dict(b=b, s_q=s, s_kv=s, h=h, d_qk=d, d_v=512, k=k, dtype="bfloat16",
                      sink=True),
        "custom_calls": [c for c in ("jax_dsa_sparse_mla_fwd_cuda", "jax_dsa_dsa_bwd_cuda")
                         if c in hlo],
        # the loss is a sum of terms of both signs: its relative error is not informative
        "value": [float(got[0]), float(want[0])],
        "rel_l2": {name: rel_l2(x, y) for name, x, y in
                   zip(("dq", "dkv", "d_attn_sink"), got[1], want[1])},
    }
    print(json.dumps(res))
    common.write_json(common.out_path(a.out, __file__, devices=jax.devices()), res)


if __name__ == "__main__":
    main()
