"""Reference side of the interop parity tests: runs in the torch + transformers interpreter.

Run as ``.venv-hf/bin/python tests/hf_reference/hf_reference.py JOB.json`` (Python 3.10+, torch CPU,
transformers 5.24; see scripts/setup.sh). It never imports jax_dsa. The job is a JSON object:

``make`` (optional list): build random transformers models and ``save_pretrained`` them::

    {"model_type": "glm_moe_dsa" | "deepseek_v32", "config": {...HF config kwargs...},
     "out": DIR, "seed": 0, "max_shard_size": "200KB" (optional), "attn_gain": 2.0}

  Weights are drawn large enough for attention to be peaked (so that the top-k choice changes
  the output): every linear weight ~ N(0, 1 / fan_in) (x ``attn_gain`` for ``q_b_proj`` and
  ``kv_b_proj``), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2), norm biases and the MoE
  correction bias ~ N(0, 0.1^2).

``runs`` (optional list), after the ``make`` jobs: load a checkpoint directory with
``from_pretrained`` (float32, eager attention) and run it on ``input_ids``::

    {"ckpt": DIR, "input_ids": [[...], ...], "out": NPZ, "config_overrides": {...} (optional)}

  The NPZ holds ``logits [B, S, V]`` and, per layer ``i``, ``attn_in_i`` (the attention input
  after ``input_layernorm``), ``attn_out_i`` (the attention output after ``o_proj``) and, for
  layers that run an indexer, ``topk_i [B, S, K]`` (transformers' raw top-k, which for query
  ``t < K`` also lists masked keys ``> t``).

Exit status 3 (with a message on stderr) when torch / transformers / the model classes are
missing, so that the tests can skip rather than fail.
"""

from __future__ import annotations

import json
import math
import sys

try:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    _ = (transformers.GlmMoeDsaForCausalLM, transformers.DeepseekV32ForCausalLM)
except (ImportError, AttributeError) as exc:  # reported to the tests as "skip"
    print(f"hf_reference: the reference interpreter lacks {exc}", file=sys.stderr)
    sys.exit(3)

CONFIG_CLASSES = {
    "glm_moe_dsa": transformers.GlmMoeDsaConfig,
    "deepseek_v32": transformers.DeepseekV32Config,
}
MODEL_CLASSES = {
    "glm_moe_dsa": transformers.GlmMoeDsaForCausalLM,
    "deepseek_v32": transformers.DeepseekV32ForCausalLM,
}


def randomize(model: torch.nn.Module, seed: int, attn_gain: float) -> None:
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            leaf = name.rsplit(".", 2)
            if "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + normal(p.shape, 0.1))
            elif name.endswith(".bias"):
                p.copy_(normal(p.shape, 0.1))
            elif "embed_tokens" in name:
                p.copy_(normal(p.shape, 1.0))
            else:  # [out, in] or stacked experts [E, out, in]
                gain = attn_gain if leaf[-2] in ("q_b_proj", "kv_b_proj") else 1.0
                p.copy_(normal(p.shape, gain / math.sqrt(p.shape[-1])))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.1))


def make(job: dict) -> None:
    model_type = job["model_type"]
    config = CONFIG_CLASSES[model_type](**job["config"])
    torch.manual_seed(job.get("seed", 0))
    model = MODEL_CLASSES[model_type](config).float().eval()
    randomize(model, job.get("seed", 0), job.get("attn_gain", 2.0))
    kw = {"max_shard_size": job["max_shard_size"]} if job.get("max_shard_size") else {}
    model.save_pretrained(job["out"], **kw)


def run(job: dict) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        job["ckpt"], dtype=torch.float32, attn_implementation="eager",
        **job.get("config_overrides", {}),
    ).eval()
    ids = torch.tensor(job["input_ids"], dtype=torch.long)
    out: dict[str, np.ndarray] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def attn_hook(module, args, kwargs, output, i=i):
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            out[f"attn_in_{i}"] = x.detach().numpy().copy()
            out[f"attn_out_{i}"] = output[0].detach().numpy().copy()

        hooks.append(attn.register_forward_hook(attn_hook, with_kwargs=True))
        if getattr(attn, "indexer", None) is not None:

            def topk_hook(module, args, output, i=i):
                out[f"topk_{i}"] = output.detach().numpy().astype(np.int32)

            hooks.append(attn.indexer.register_forward_hook(topk_hook))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    out["logits"] = logits.detach().numpy()
    np.savez(job["out"], **out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        job = json.load(f)
    torch.set_num_threads(1)
    for m in job.get("make", []):
        make(m)
    for r in job.get("runs", []):
        run(r)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
