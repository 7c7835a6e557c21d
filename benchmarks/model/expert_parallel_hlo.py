"""What expert parallelism adds to a MoE layer's compiled step, read off the compiled HLO on the
host's 8-device CPU mesh at GLM-5 and DeepSeek V4-Flash expert dims (bf16; nothing is run or
allocated: the programs are compiled from shapes).

One routed-experts layer forward and backward (``jax_dsa.nn.experts.Experts``, loss
``sum(y * y)``), ``--tokens`` tokens per device, in four layouts:

* ``replicated``: ``dp=8``, every device holds all experts (the baseline);
* ``ep8-capacity``: ``ep=8``, ``jax.lax.all_to_all`` of ``[ep, C, hidden]`` blocks, ``C`` the
  dropless worst case (every pair of a device to one destination);
* ``ep8-capacity-1.25``: the same with ``capacity_factor=1.25`` (pairs past 1.25x the balanced
  share are dropped and counted);
* ``ep8-ragged``: ``jax.lax.ragged_all_to_all``, exact rows. XLA:CPU cannot compile it, so its
  collectives are read from the lowered (StableHLO) program and its bytes are the rows it moves
  when routing is balanced (the sent rows are data-dependent).

For each: the collectives (op, count, bytes of their results per device), the per-device bytes
of the expert parameters, and XLA's memory analysis (arguments, temporaries) per device.

    .venv/bin/python benchmarks/model/expert_parallel_hlo.py [--tokens 4096] [--out [FILE]]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_dsa.configs import get_config  # noqa: E402
from jax_dsa.models.deepseek_v4.moe import V4Experts  # noqa: E402
from jax_dsa.nn.experts import Experts, set_expert_dispatch  # noqa: E402
from jax_dsa.sharding import logical_to_spec  # noqa: E402

MODELS = {"glm5": (Experts, "glm5"), "deepseek-v4-flash": (V4Experts, "deepseek-v4-flash")}
LAYOUTS = {  # name -> (mesh, dispatch, capacity_factor)
    "replicated": ({"dp": 8}, None, None),
    "ep8-capacity": ({"ep": 8}, "capacity", None),
    "ep8-capacity-1.25": ({"ep": 8}, "capacity", 1.25),
    "ep8-ragged": ({"ep": 8}, "ragged", None),
}
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "pred": 1, "s8": 1}


def collectives(text):
    """``{op: {"count", "bytes"}}`` of compiled HLO text (bytes of the results, per device)."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce|all-to-all|"
                      r"ragged-all-to-all|collective-permute)(?:-start)?\(", line)
        if not m:
            continue
        size = sum(_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                   for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)))
        entry = out.setdefault(m.group(2), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += size
    return out


def lowered_collectives(text):
    """Collective ops of a lowered (StableHLO) program: ``{op: count}``."""
    ops = re.findall(r"(stablehlo\.all_to_all|stablehlo\.all_gather|stablehlo\.all_reduce|"
                     r"stablehlo\.reduce_scatter|@ragged_all_to_all|\"ragged_all_to_all\")", text)
    counts = {}
    for op in ops:
        name = op.strip('@"').replace("stablehlo.", "").replace("_", "-")
        counts[name] = counts.get(name, 0) + 1
    return counts


def measure(model, layout, tokens):
    cls, preset = MODELS[model]
    config = get_config(preset)
    sizes, dispatch, factor = LAYOUTS[layout]
    layer = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                       param_dtype=jnp.bfloat16))
    set_expert_dispatch(layer, dispatch, factor)
    graphdef, state = nnx.split(layer)
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(AxisType.Explicit,) * len(sizes))
    n = int(np.prod(list(sizes.values())))
    t, k, h = tokens * n, config.num_experts_per_tok, config.hidden_size

    def step(state, x, w, idx):
        def loss(state, x, w):
            y = nnx.merge(graphdef, state)(x, w, idx, implementation="xla")
            return (y.astype(jnp.float32) ** 2).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(state, x, w)

    with jax.set_mesh(mesh):
        specs = nnx.get_partition_spec(state)
        abstract = jax.tree.map(
            lambda s, v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
                mesh, logical_to_spec(tuple(s), mesh=mesh, shape=v.shape))),
            specs, state, is_leaf=lambda s: isinstance(s, P))
        tok = NamedSharding(mesh, P(tuple(sizes)))
        args = (jax.ShapeDtypeStruct((t, h), jnp.bfloat16, sharding=tok),
                jax.ShapeDtypeStruct((t, k), jnp.float32, sharding=tok),
                jax.ShapeDtypeStruct((t, k), jnp.int32, sharding=tok))
        lowered = jax.jit(step).lower(abstract, *args)
        expert_bytes = sum(
            int(np.prod(v.sharding.shard_shape(v.shape))) * v.dtype.itemsize
            for v in jax.tree.leaves(abstract))
        entry = {"mesh": sizes, "dispatch": dispatch, "capacity_factor": factor,
                 "expert_param_bytes_per_device": expert_bytes}
        if dispatch == "ragged":  # XLA:CPU: UNIMPLEMENTED ragged-all-to-all
            entry["lowered_collectives"] = lowered_collectives(lowered.as_text())
            # balanced routing: (ep-1)/ep of the pairs leave, in each of the 4 exchanges
            pairs = tokens * k
            entry["balanced_bytes_sent_per_exchange"] = int(pairs * h * 2 * (n - 1) / n)
            return entry
        compiled = lowered.compile()
        entry["collectives"] = collectives(compiled.as_text())
        mem = compiled.memory_analysis()
        entry["memory_per_device"] = {
            "arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
            "temporaries": int(mem.temp_size_in_bytes)}
        return entry


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    common.add_result_args(p)
    args = p.parse_args(argv)
    results = {}
    for model in args.models:
        config = get_config(MODELS[model][1])
        results[model] = {"hidden_size": config.hidden_size,
                          "moe_intermediate_size": config.moe_intermediate_size,
                          "n_routed_experts": config.n_routed_experts,
                          "num_experts_per_tok": config.num_experts_per_tok, "layouts": {}}
        for layout in args.layouts:
            entry = measure(model, layout, args.tokens)
            results[model]["layouts"][layout] = entry
            colls = entry.get("collectives") or entry.get("lowered_collectives")
            print(f"{model:18s} {layout:18s} experts/device "
                  f"{entry['expert_param_bytes_per_device'] / 2**30:6.2f} GiB  {colls}",
                  flush=True)
    report = {
        "what": "one routed-experts layer, forward + backward, compiled for the 8-device CPU "
                "mesh from shapes (bf16); bytes per device",
        "tokens_per_device": args.tokens,
        "benchmark": "benchmarks/model/expert_parallel_hlo.py",
        "commit": common.commit(args.commit), "date": common.today(),
        "results": results,
    }
    common.write_json(common.out_path(args.out, __file__), report)
    return report


if __name__ == "__main__":
    main()
