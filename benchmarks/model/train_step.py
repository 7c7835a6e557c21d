"""A model's training step at real dimensions on one GPU: step time, tokens/s, model FLOP/s
against the same run's bf16 matmul (MFU), peak memory.

    python benchmarks/model/train_step.py --model glm5 --layers 4 --dense-layers 1 \
        --experts 64 --seq 16384 [--steps 5] [--out [FILE]]
    python benchmarks/model/train_step.py --model deepseek-v4-flash --layers 4 --experts 64 ...

The model is the preset's (hidden size, heads, indexer, expert dims, vocabulary) cut to its first
``--layers`` layers: GLM-5 with ``--dense-layers`` dense MLP layers, then MoE layers with
``--experts`` routed experts; DeepSeek V4-Flash with its own first layer and MoE schedule
(sliding, sliding, CSA, HCA...; hash-routed, then top-k routed) and ``--experts`` experts.
Parameters are bfloat16; one step is the forward, the backward (next-token cross-entropy plus the
indexer KL loss, sparse attention) and an in-place SGD update (parameters donated), jitted.

Model FLOPs of a step (the numerator of the MFU): ``6 * tokens * active matmul parameters``
(every >= 2-D weight except the embedding table; a routed expert's weights count
``num_experts_per_tok / n_routed_experts`` of their size), plus the attention's: per layer and
query ``2 * heads * visible_slots * (D_qk + D_v)`` forward, times 3.5 for forward and backward
(the backward does 2.5 times the forward's work), ``visible_slots = min(topk, t + 1)`` for a
causal top-k layer, ``min(window, t + 1)`` more for V4's sliding window. The indexer's scores and
the compressors are not counted (so the MFU is a lower bound). The denominator is the same
process's 8192^3 bf16 ``jnp.dot`` (:func:`benchmarks.common.matmul_tflops`).
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
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_dsa.configs import get_config  # noqa: E402


def build(name, layers, dense_layers, experts, vocab):
    """``(config, model)`` for the preset ``name`` cut to ``layers`` layers."""
    over = {"num_hidden_layers": layers}
    if experts:
        over["n_routed_experts"] = experts
    if vocab:
        over["vocab_size"] = vocab
    if name.startswith("deepseek-v4"):
        from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel as Model
        base = get_config(name)
        over["layer_types"] = base.layer_types[:layers]
        over["mlp_layer_types"] = base.mlp_layer_types[:layers]
    else:
        from jax_dsa.models.glm.model import DSALanguageModel as Model
        over["mlp_layer_types"] = ("dense",) * dense_layers + ("sparse",) * (layers - dense_layers)
        if get_config(name).n_group > 1 and experts:
            over["n_group"], over["topk_group"] = 1, 1  # group-limited routing needs E % n_group
    c = get_config(name, **over)
    model = Model(c, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    return c, model


def active_matmul_params(c, params) -> float:
    """Matmul parameters a token goes through (see the module docstring)."""
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        if leaf.ndim < 2 or "embed_tokens" in keys:
            continue
        frac = 1.0
        if "experts" in keys and "shared_experts" not in keys:
            frac = c.num_experts_per_tok / c.n_routed_experts
        total += frac * leaf.size
    return total


def attention_flops(c, s) -> float:
    """Forward+backward FLOPs of the attention cores of one row of ``s`` tokens."""
    t = np.arange(s, dtype=np.float64) + 1  # visible keys of each query (causal)
    if hasattr(c, "layer_types"):  # DeepSeek V4: K = V rows of head_dim, sliding window always
        d = c.head_dim + c.head_dim
        total = 0.0
        for kind in c.layer_types:
            slots = np.minimum(c.sliding_window, t)
            if kind == "compressed_sparse_attention":
                slots = slots + np.minimum(c.index_topk, t // c.compress_rate_csa)
            elif kind == "heavily_compressed_attention":
                slots = slots + t // c.compress_rate_hca
            total += 2 * c.num_attention_heads * d * slots.sum()
    else:
        d = (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
        slots = np.minimum(c.index_topk, t).sum()
        total = c.num_hidden_layers * 2 * c.num_attention_heads * d * slots
    return 3.5 * total


def make_step(model, implementation, lr=1e-6):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, rest, ids):
        logits, aux = nnx.merge(graphdef, p, rest)(ids, implementation=implementation)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()
        return nll + aux["indexer_loss"], nll

    def step(p, rest, ids):
        g, nll = jax.grad(loss_fn, has_aux=True)(p, rest, ids)
        p = jax.tree.map(lambda w, d: (w - lr * d.astype(jnp.float32)).astype(w.dtype), p, g)
        return p, nll

    return jax.jit(step, donate_argnums=0), params, rest


def run(a):
    c, model = build(a.model, a.layers, a.dense_layers, a.experts, a.vocab)
    step, params, rest = make_step(model, a.implementation)
    del model
    n_active = active_matmul_params(c, params)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    ids = jax.random.randint(jax.random.key(2), (1, a.seq), 0, c.vocab_size, jnp.int32)
    t0 = time.perf_counter()
    params, nll = step(params, rest, ids)
    jax.block_until_ready(nll)
    first = time.perf_counter() - t0
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        params, nll = step(params, rest, ids)
        jax.block_until_ready(nll)
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)
    flops = 6 * a.seq * n_active + attention_flops(c, a.seq)
    stats = jax.devices()[0].memory_stats() or {}
    out = {"model": a.model, "layers": a.layers, "seq": a.seq,
           "mlp_layer_types": list(c.mlp_layer_types),
           "n_routed_experts": c.n_routed_experts, "num_experts_per_tok": c.num_experts_per_tok,
           "vocab_size": c.vocab_size, "params_b": round(n_params / 1e9, 3),
           "active_matmul_params_b": round(n_active / 1e9, 3),
           "first_step_s": round(first, 2), "median_ms": round(ms, 2),
           "min_ms": round(1e3 * min(times), 2), "tokens_per_s": round(a.seq / ms * 1e3),
           "model_tflop": round(float(flops) / 1e12, 2),
           "tflop_per_s": round(float(flops) / ms / 1e9, 1), "loss": float(nll)}
    if "peak_bytes_in_use" in stats:
        out["peak_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 2)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="glm5", help="a full-size preset (glm5, deepseek-v4-flash)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense-layers", type=int, default=1, help="GLM: dense MLP layers first")
    p.add_argument("--experts", type=int, default=None, help="routed experts (preset's: None)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (preset's: None)")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--implementation", default=None)
    p.add_argument("--tag", default=None, help="result file tag")
    common.add_result_args(p, "--tag")
    a = p.parse_args(argv)
    rate = common.matmul_tflops()
    res = run(a)
    res["mfu"] = round(res["tflop_per_s"] / rate, 3)
    out = {"benchmark": "benchmarks/model/train_step.py", "date": common.today(),
           "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
           "commit": common.commit(a.commit), "implementation": a.implementation,
           "steps": a.steps, "matmul_8192_tflop_per_s": round(rate, 1),
           "shapes": "one row of --seq tokens, bfloat16 parameters, random weights and tokens, "
                     "sparse attention with the indexer KL loss, SGD update", "result": res}
    print(json.dumps(out, indent=1), flush=True)
    common.write_json(common.out_path(a.out, __file__, a.tag), out)


if __name__ == "__main__":
    main()
