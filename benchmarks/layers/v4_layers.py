"""DeepSeek V4 attention layers: slot-width buckets over sequence lengths, and layer timing.

    .venv/bin/python benchmarks/layers/v4_layers.py buckets [--out [FILE]]
    .venv/bin/python benchmarks/layers/v4_layers.py time --model deepseek-v4-flash --seq-len 8192 \
        --implementation xla [--out [FILE]]

``buckets`` (no compilation, any machine): for V4-Flash and V4-Pro and every sequence length
from 1K to 32K in steps of 128 tokens, the slot width of each layer type (window-only, CSA, HCA)
with and without the bucket ladder of :mod:`jax_dsa.models.deepseek_v4.slots`. The width is the
compile key of the GPU sparse-attention kernels (one artifact per (heads, D, width)), so the
number of distinct (layer type, width) pairs is the number of kernel programs a run over those
lengths needs. It also checks, on the tiny V4 at a few short lengths, that the slot lists the layers
actually build have exactly the predicted width.

``time``: forward+backward wall time of one layer of each type (random weights, one batch row)
for the given model dimensions, sequence length, attention mode and implementation; the median of
``--repeats`` runs after one compile-and-warm-up run. ``--max-listed N`` sets
``jax_dsa.models.deepseek_v4.attention.MAX_LISTED_ENTRIES`` (past it, HCA and dense CSA take every
visible compressed entry through ``sparse_dense_mla`` instead of a slot list), to time both paths.
Meant for GPUs. ``--out`` alone writes ``v4_layers_<gpu>_buckets.json`` or
``v4_layers_<gpu>_<seq-len>[_dense]_<implementation>.json`` in ``benchmarks/results/``.
"""

from __future__ import annotations

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
from flax import nnx  # noqa: E402

from jax_dsa.configs import get_config  # noqa: E402
from jax_dsa.models.deepseek_v4 import attention as v4_attention  # noqa: E402
from jax_dsa.models.deepseek_v4.attention import DeepseekV4Attention  # noqa: E402
from jax_dsa.models.deepseek_v4.config import LAYER_TYPES  # noqa: E402
from jax_dsa.models.deepseek_v4.slots import compressed_slot_count, slot_width  # noqa: E402


def bucket_report(lengths=range(1024, 32768 + 1, 128)) -> dict:
    report = {"lengths": {"first": lengths[0], "last": lengths[-1], "step": lengths.step,
                          "count": len(lengths)}, "models": {}}
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        c = get_config(name)
        entry = {}
        for mode in ("sparse", "dense"):
            per_type, raw_per_type = {}, {}
            for t in LAYER_TYPES:
                widths = sorted({slot_width(c, t, s, mode) for s in lengths})
                raw = {min(c.sliding_window, s) + compressed_slot_count(c, t, s, mode)
                       for s in lengths}
                per_type[t] = widths
                raw_per_type[t] = len(raw)
            entry[mode] = {
                "bucketed_widths": per_type,
                "programs_bucketed": sum(len(w) for w in per_type.values()),
                "programs_unbucketed": sum(raw_per_type.values()),
            }
        entry["layer_count"] = {t: c.layer_types.count(t) for t in LAYER_TYPES}
        report["models"][name] = entry
    return report


def check_built_widths(lengths=(64, 200, 512)) -> list[dict]:
    """The tiny V4's layers, run at a few lengths: the slot lists have the predicted width."""
    c = get_config("deepseek-v4-tiny")
    rows = []
    for i, t in enumerate(c.layer_types[:3]):
        attn = DeepseekV4Attention(c, i, rngs=nnx.Rngs(i))
        for s in lengths:
            x = jnp.zeros((1, s, c.hidden_size))
            shapes = jax.eval_shape(lambda x, a=attn: a(x, compute_indexer_loss=False)[1], x)
            built = shapes["indices"].shape[-1]
            rows.append({"layer_type": t, "seq_len": s, "built": built,
                         "predicted": slot_width(c, t, s)})
            if built != slot_width(c, t, s):
                raise AssertionError(f"{t} at {s}: built width {built} != {slot_width(c, t, s)}")
    return rows


def make_layer_step(c, i: int, seq_len: int, implementation, dtype, mode: str = "sparse"):
    """``(fwd_bwd, args)``: layer ``i``'s jitted forward+backward ``fwd_bwd(*args)`` (the indexer
    loss included where the layer has one), with random weights and the input of one row as its
    arguments (none closed over: XLA would fold them into the program as constants)."""
    attn = DeepseekV4Attention(c, i, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    graphdef, params, rest = nnx.split(attn, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(0), (1, seq_len, c.hidden_size), dtype)

    @jax.jit
    def fwd_bwd(p, rest, x):
        def loss(p, x):
            y, aux = nnx.merge(graphdef, p, rest)(x, attention_mode=mode,
                                                  implementation=implementation)
            return jnp.mean(y.astype(jnp.float32) ** 2) + (
                aux["indexer_loss"] if aux["indexer_loss"] is not None else 0.0)
        return jax.grad(loss, argnums=(0, 1))(p, x)

    return fwd_bwd, (params, rest, x)


def time_layers(model: str, seq_len: int, implementation, repeats: int, dtype,
                mode: str = "sparse") -> dict:
    c = get_config(model)
    out = {"model": model, "seq_len": seq_len, "implementation": implementation,
           "attention_mode": mode, "max_listed_entries": v4_attention.MAX_LISTED_ENTRIES,
           "dtype": jnp.dtype(dtype).name, "device": str(jax.devices()[0]), "layers": {}}
    for t in LAYER_TYPES:
        i = c.layer_types.index(t) if t in c.layer_types else None
        if i is None:
            continue
        fwd_bwd, args = make_layer_step(c, i, seq_len, implementation, dtype, mode)
        t0 = time.perf_counter()
        jax.block_until_ready(fwd_bwd(*args))
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fwd_bwd(*args))
            runs.append(time.perf_counter() - t0)
        out["layers"][t] = {"layer_idx": i, "slot_width": slot_width(c, t, seq_len, mode),
                            "first_call_s": compile_s, "median_s": statistics.median(runs),
                            "runs_s": runs}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("buckets")
    common.add_result_args(b)
    t = sub.add_parser("time")
    t.add_argument("--model", default="deepseek-v4-flash")
    t.add_argument("--seq-len", type=int, default=8192)
    t.add_argument("--implementation", default=None)
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--attention-mode", choices=("sparse", "dense"), default="sparse")
    t.add_argument("--max-listed", type=int, default=None,
                   help="override MAX_LISTED_ENTRIES (compressed entries listed as slots)")
    common.add_result_args(t)
    args = p.parse_args(argv)
    if args.cmd == "buckets":
        result = bucket_report()
        result["tiny_built_widths"] = check_built_widths()
        tag = "buckets"
    else:
        if args.max_listed is not None:
            v4_attention.MAX_LISTED_ENTRIES = args.max_listed
        result = time_layers(args.model, args.seq_len, args.implementation, args.repeats,
                             jnp.dtype(args.dtype), args.attention_mode)
        tag = "_".join([str(args.seq_len)] + (["dense"] if args.attention_mode == "dense" else [])
                       + [args.implementation or "default"])
    result.update(benchmark=f"benchmarks/layers/v4_layers.py {args.cmd}", date=common.today(),
                  commit=common.commit(args.commit))
    if args.cmd == "time":
        result["gpu"] = jax.devices()[0].device_kind
    print(json.dumps(result, indent=1))
    common.write_json(common.out_path(args.out, __file__, tag), result)
    return result


if __name__ == "__main__":
    main()
