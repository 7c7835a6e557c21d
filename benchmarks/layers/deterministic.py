"""What ``deterministic=True`` costs and gives: a GLM-5 DSA layer's training step on a GPU.

    python benchmarks/layers/deterministic.py --sizes 16384,65536 [--repeats 5] [--ops-only]
        [--out [FILE]]

For each sequence length (one batch row, bfloat16, GLM-5 dims, sparse mode with the indexer KL
loss, every op on ``"cuda"``; the step of ``benchmarks/layers/dsa_layer.py``): the step's median
time with the default backward (``"auto"``: cuDNN's below ``OWN_BWD_MIN_S_KV`` keys, jax_dsa's
atomic mode from there on), with cuDNN's (``JAX_DSA_SPARSE_MLA_BWD=cudnn``, float32 atomics),
with jax_dsa's own backward in its atomic mode (``=jax_dsa``) and with ``deterministic=True``
(jax_dsa's own backward in its deterministic mode, d index_k in fixed point), and how many gradient elements
differ between two runs of each on the same inputs (0 for the deterministic step: bitwise
identical). Also ``sparse_mla`` alone at K 2048 on the indexer's causal top-k, the three ways:
forward+backward, the forward alone, and from them the backward's time and TFLOP/s (2.5 times
the forward's FLOPs over the valid slots). ``--ops-only``: these op rows alone (e.g. at 128K).
``--env-mode NAME:MODE:VAR=VALUE[,VAR=VALUE]`` (repeatable; MODE ``default`` or
``deterministic``) also times that layer step with the variables set for all its calls (kernel
variants chosen at launch, e.g. ``JAX_DSA_KL_DET_BULK=1``), and counts the gradient elements that
differ from the plain MODE step's (0 expected only where the variant sums in the same order) and
the largest relative L2 distance of a gradient from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402
from benchmarks.layers.dsa_layer import make_layer_step, op_inputs, timed  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_dsa import indexer_topk, sparse_mla  # noqa: E402
from jax_dsa.configs import get_config  # noqa: E402
from jax_dsa.ops.sparse_mla.cuda import BWD_KERNEL_ENV  # noqa: E402

# (name, deterministic, JAX_DSA_SPARSE_MLA_BWD while tracing)
MODES = (("default", False, "auto"), ("cudnn", False, "cudnn"),
         ("jax_dsa_atomic", False, "jax_dsa"), ("deterministic", True, "auto"))


@contextlib.contextmanager
def env_set(assignments):
    """Sets ``{VAR: VALUE}`` in os.environ for the block, then restores the old values."""
    old = {var: os.environ.get(var) for var in assignments}
    os.environ.update(assignments)
    try:
        yield
    finally:
        for var, value in old.items():
            if value is None:
                os.environ.pop(var)
            else:
                os.environ[var] = value


def backward_env(value):
    return env_set({BWD_KERNEL_ENV: value})


def env_mode(text):
    """``NAME:MODE:VAR=VALUE[,VAR=VALUE]`` -> (NAME, deterministic, {VAR: VALUE})."""
    parts = text.split(":", 2)
    pairs = [x.partition("=") for x in parts[2].split(",")] if len(parts) == 3 else []
    if (len(parts) != 3 or not parts[0] or parts[1] not in ("default", "deterministic")
            or not pairs or not all(var and eq for var, eq, _ in pairs)):
        raise argparse.ArgumentTypeError(
            f"--env-mode {text!r}: expected NAME:default|deterministic:VAR=VALUE[,VAR=VALUE]")
    return parts[0], parts[1] == "deterministic", {var: value for var, _, value in pairs}


def differing(a, b):
    """Elements that differ between two gradient pytrees (NaN == NaN), and their total."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    diff = sum(int(np.sum(~((np.asarray(x) == np.asarray(y)) |
                            (np.isnan(np.asarray(x, np.float32)) &
                             np.isnan(np.asarray(y, np.float32)))))) for x, y in zip(la, lb))
    return diff, sum(int(np.size(x)) for x in la)


def worst_rel_l2(a, b):
    """The largest ||x - y|| / ||y|| over the leaves of two gradient pytrees (float64)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return worst


def layer_rows(c, s, repeats, env_modes=()):
    row, base = {}, {}  # base: the default and deterministic steps' first gradients
    for name, det, env in MODES:
        with backward_env(env):  # the ops read it when traced: the first call
            step, args = make_layer_step(c, s, "cuda", deterministic=det)
            first, second = step(*args), step(*args)
        diff, total = differing(first, second)
        if name in ("default", "deterministic") and env_modes:
            base[name] = first
        del first, second
        row[name] = {**timed(step, *args, repeats=repeats), "differing_elements": diff,
                     "elements": total}
    for name, det, assignments in env_modes:
        with env_set(assignments):  # for every call: a kernel launch may read them each time
            step, args = make_layer_step(c, s, "cuda", deterministic=det)
            first, second = step(*args), step(*args)
            diff, total = differing(first, second)
            mode = "deterministic" if det else "default"
            row[name] = {**timed(step, *args, repeats=repeats),
                         "env": ",".join(f"{k}={v}" for k, v in assignments.items()),
                         "differing_elements": diff, "elements": total,
                         f"differing_from_{mode}": differing(first, base[mode])[0],
                         f"worst_rel_l2_from_{mode}": worst_rel_l2(first, base[mode])}
            del first, second
    row["deterministic_over_default"] = round(
        row["deterministic"]["median_ms"] / row["default"]["median_ms"], 3)
    return row


def op_rows(c, s, repeats):
    q, kv, iq, ik, w, pos = op_inputs(c, s)
    idx = jax.jit(lambda iq, ik, w, pos: indexer_topk(
        iq, ik, w, topk=c.index_topk, q_positions=pos, kv_positions=pos,
        implementation="cuda"))(iq, ik, w, pos)
    h, d_qk = q.shape[1:]
    pairs = int(jnp.sum(idx >= 0))  # causal: fewer than K valid slots for the first queries
    fwd_flop = 2 * pairs * h * (d_qk + c.kv_lora_rank)
    fwd = jax.jit(lambda q, kv, idx: sparse_mla(q, kv, idx, sm_scale=c.softmax_scale,
                                                d_v=c.kv_lora_rank, implementation="cuda")[0])
    row = {"valid_pairs": pairs, "forward": timed(fwd, q, kv, idx, repeats=repeats)}
    for name, det, env in MODES:
        @jax.jit
        def attn(q, kv, idx, det=det):
            def f(q, kv):
                o, _ = sparse_mla(q, kv, idx, sm_scale=c.softmax_scale, d_v=c.kv_lora_rank,
                                  implementation="cuda", deterministic=det)
                return jnp.mean(o.astype(jnp.float32) ** 2)
            return jax.grad(f, argnums=(0, 1))(q, kv)
        with backward_env(env):
            attn(q, kv, idx)  # traced here
        row[name] = timed(attn, q, kv, idx, repeats=repeats)
        bwd_ms = row[name]["median_ms"] - row["forward"]["median_ms"]
        row[name]["backward_ms"] = round(bwd_ms, 3)  # fwd+bwd minus the forward alone
        row[name]["backward_tflops"] = (round(2.5 * fwd_flop / bwd_ms / 1e9, 1) if bwd_ms > 0
                                        else None)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16384,65536")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops-only", action="store_true", help="skip the layer step (op rows only)")
    p.add_argument("--env-mode", type=env_mode, action="append", default=[],
                   metavar="NAME:MODE:VAR=VALUE[,VAR=VALUE]",
                   help="a layer mode (MODE default or deterministic) run with these variables")
    common.add_result_args(p)
    a = p.parse_args(argv)
    c = get_config("glm5")
    res = {"benchmark": "benchmarks/layers/deterministic.py", "commit": common.commit(a.commit),
           "date": common.today(), "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
           "model": "glm5 (hidden 6144, H 64, D_qk 576, index 32 x 128, top-k 2048), one "
                    "batch row, bfloat16, sparse mode with the KL loss, implementation cuda",
           "repeats": a.repeats, "sizes": {}}
    for s in [int(x) for x in a.sizes.split(",") if x]:
        row = {} if a.ops_only else {"layer_fwd_bwd": layer_rows(c, s, a.repeats, a.env_mode)}
        row["sparse_mla_fwd_bwd"] = op_rows(c, s, a.repeats)
        res["sizes"][str(s)] = row
        print(s, json.dumps(row), flush=True)
    common.write_json(common.out_path(a.out, __file__), res)
    return res


if __name__ == "__main__":
    main()
