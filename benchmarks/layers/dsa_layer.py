"""One GLM-5 DSA attention layer's training step on a GPU, and its DSA ops alone, same process.

    python benchmarks/layers/dsa_layer.py --sizes 4096,8192,16384 [--layer-only 32768] \
        [--dense 16384,65536] [--implementation cuda] [--out [FILE]]

For each sequence length (one batch row, bfloat16, random weights, GLM-5 dimensions from
``get_config("glm5")``): the jitted forward+backward of ``DSAAttention`` in sparse mode with the
indexer KL loss, the same without it, and each op alone with the layer's shapes: ``sparse_mla``
forward+backward (K 2048), ``indexer_topk`` (with the selected keys' scores, as the layer calls
it), and the sparse ``indexer_kl_loss`` forward+backward (with ``sparse_mla``'s lse and the
top-k's scores, as the layer calls it; and with the scores recomputed).
Times are wall time around ``block_until_ready``, the median of ``--repeats`` runs after a first
call whose time (compile + run) is reported too. ``--implementation`` goes to every op (``None``:
each op's default order for the platform). ``--dense S,...``: the dense-mode (warm-up) layer step,
whole and with only the indexer trained; its result is kept as ``dsa_layer_<gpu>_dense.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jax_dsa import indexer_kl_loss, indexer_topk, sparse_mla  # noqa: E402
from jax_dsa.configs import get_config  # noqa: E402
from jax_dsa.nn import DSAAttention  # noqa: E402


def timed(fn, *args, repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    return {"first_call_s": round(first, 3), "median_ms": round(1e3 * statistics.median(runs), 3),
            "min_ms": round(1e3 * min(runs), 3)}


def make_layer_step(c, s, implementation, kl=True, mode="sparse", frozen=False,
                    deterministic=None):
    """``(step, args)``: the layer's jitted forward+backward ``step(*args)`` with random weights
    and the input of one batch row as its arguments (none closed over: XLA would fold them into
    the program as constants); ``frozen``: the dense warm-up's recipe (DeepSeek-V3.2 §2.1), the
    gradient of the indexer loss in the indexer's parameters alone; ``deterministic``: the
    layer's argument."""
    attn = DSAAttention(c, 0, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1, s, c.hidden_size), jnp.bfloat16)

    if frozen:
        graphdef, index_p, params, rest = nnx.split(attn, nnx.All(nnx.Param, nnx.PathContains(
            "indexer")), nnx.Param, ...)

        @jax.jit
        def step(index_p, p, rest, x):
            def loss(ip):
                _, aux = nnx.merge(graphdef, ip, p, rest)(x, attention_mode=mode,
                                                          implementation=implementation,
                                                          deterministic=deterministic)
                return aux["indexer_loss"]
            return jax.grad(loss)(index_p)
        return step, (index_p, params, rest, x)

    graphdef, params, rest = nnx.split(attn, nnx.Param, ...)

    @jax.jit
    def step(p, rest, x):
        def loss(p, x):
            y, aux = nnx.merge(graphdef, p, rest)(x, attention_mode=mode,
                                                  implementation=implementation,
                                                  compute_indexer_loss=kl,
                                                  deterministic=deterministic)
            total = jnp.mean(y.astype(jnp.float32) ** 2)
            return total + (aux["indexer_loss"] if kl else 0.0)
        return jax.grad(loss, argnums=(0, 1))(p, x)
    return step, (params, rest, x)


def layer_step(c, s, implementation, kl, repeats, mode="sparse", frozen=False):
    """Times :func:`make_layer_step`'s step, with its compiled memory."""
    step, args = make_layer_step(c, s, implementation, kl, mode, frozen)
    out = timed(step, *args, repeats=repeats)
    mem = step.lower(*args).compile().memory_analysis()
    if mem is not None:  # the compiled step's own buffers: temporaries, arguments, outputs
        out["compiled_gib"] = round((mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                     + mem.output_size_in_bytes) / 2**30, 3)
    return out


def op_inputs(c, s):
    ks = jax.random.split(jax.random.key(2), 6)
    h, d_qk = c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim
    q = jax.random.normal(ks[0], (s, h, d_qk), jnp.bfloat16)
    kv = jax.random.normal(ks[1], (s, d_qk), jnp.bfloat16)
    iq = jax.random.normal(ks[2], (s, c.index_n_heads, c.index_head_dim), jnp.bfloat16)
    ik = jax.random.normal(ks[3], (s, c.index_head_dim), jnp.bfloat16)
    w = jax.random.normal(ks[4], (s, c.index_n_heads), jnp.float32) * c.index_n_heads ** -0.5
    return q, kv, iq, ik, w, jnp.arange(s, dtype=jnp.int32)


def ops(c, s, implementation, repeats):
    # Every array is a jit argument: closed-over slot lists would be constant-folded by XLA
    # (minutes of compile that a training step, whose slots are values, never pays).
    q, kv, iq, ik, w, pos = op_inputs(c, s)
    k = c.index_topk
    # as the layer calls it: the selected keys' scores too, for the KL loss
    topk = jax.jit(lambda iq, ik, w, pos: indexer_topk(
        iq, ik, w, topk=k, q_positions=pos, kv_positions=pos, return_scores=True,
        implementation=implementation))
    idx, scores = topk(iq, ik, w, pos)
    out = {"indexer_topk": timed(topk, iq, ik, w, pos, repeats=repeats)}

    @jax.jit
    def attn(q, kv, idx):
        def f(q, kv):
            o, _ = sparse_mla(q, kv, idx, sm_scale=c.softmax_scale, d_v=c.kv_lora_rank,
                              implementation=implementation)
            return jnp.mean(o.astype(jnp.float32) ** 2)
        return jax.grad(f, argnums=(0, 1))(q, kv)

    out["sparse_mla_fwd_bwd"] = timed(attn, q, kv, idx, repeats=repeats)

    lse = jax.jit(lambda q, kv, idx: sparse_mla(q, kv, idx, sm_scale=c.softmax_scale,
                                                d_v=c.kv_lora_rank,
                                                implementation=implementation)[1])(q, kv, idx)

    def kl_step(given_scores):
        @jax.jit
        def kl(iq, ik, w, q, kv, pos, idx, lse, scores):
            return jax.value_and_grad(lambda iq, ik, w: indexer_kl_loss(
                iq, ik, w, q, kv, sm_scale=c.softmax_scale, q_positions=pos, kv_positions=pos,
                indices=idx, attention_lse=lse, index_scores=scores if given_scores else None,
                implementation=implementation), argnums=(0, 1, 2))(iq, ik, w)
        return kl

    # as the layer calls it: with sparse_mla's lse (the target from the attention kernel) and
    # the top-k's scores; then with the scores recomputed (the score kernel)
    kl_args = (iq, ik, w, q, kv, pos, idx, lse, scores)
    out["indexer_kl_loss_fwd_bwd"] = timed(kl_step(True), *kl_args, repeats=repeats)
    out["indexer_kl_loss_fwd_bwd_recomputed_scores"] = timed(kl_step(False), *kl_args,
                                                             repeats=repeats)
    ratio = (out["indexer_topk"]["median_ms"] + out["indexer_kl_loss_fwd_bwd"]["median_ms"]) / \
        out["sparse_mla_fwd_bwd"]["median_ms"]
    out["indexer_over_sparse_mla"] = round(ratio, 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,8192,16384")
    p.add_argument("--layer-only", default="", help="sizes timed as a whole layer step only")
    p.add_argument("--dense", default="", help="sizes timed as a dense-mode layer step (whole "
                   "layer, and frozen: the indexer loss in the indexer's parameters)")
    p.add_argument("--implementation", default=None)
    p.add_argument("--repeats", type=int, default=20)
    common.add_result_args(p, tag_help="_dense when only --dense sizes are given")
    a = p.parse_args(argv)
    c = get_config("glm5")
    res = {"benchmark": "benchmarks/layers/dsa_layer.py", "commit": common.commit(a.commit),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
           "implementation": a.implementation, "model": "glm5 (hidden 6144, H 64, D_qk 576, "
           "index 32 x 128, top-k 2048), one batch row, bfloat16", "repeats": a.repeats,
           "sizes": {}}
    sizes = [int(x) for x in a.sizes.split(",") if x]
    layer_only = [int(x) for x in a.layer_only.split(",") if x]
    for s in sizes + layer_only:
        row = {"layer_fwd_bwd": layer_step(c, s, a.implementation, True, a.repeats),
               "layer_fwd_bwd_without_kl": layer_step(c, s, a.implementation, False, a.repeats)}
        if s in sizes:
            row.update(ops(c, s, a.implementation, a.repeats))
        res["sizes"][str(s)] = row
        print(s, json.dumps(row), flush=True)
    res["dense"] = {}
    for s in [int(x) for x in a.dense.split(",") if x]:
        row = {"frozen_indexer_only": layer_step(c, s, a.implementation, True, a.repeats,
                                                 "dense", frozen=True),
               "whole_layer": layer_step(c, s, a.implementation, True, a.repeats, "dense")}
        res["dense"][str(s)] = row
        print("dense", s, json.dumps(row), flush=True)
    only_dense = res["dense"] and not res["sizes"]
    common.write_json(common.out_path(a.out, __file__, "dense" if only_dense else None), res)
    return res


if __name__ == "__main__":
    main()
