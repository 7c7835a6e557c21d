"""Reference logits of transformers' whole ``DeepseekV4ForCausalLM`` for the jax_dsa parity tests.

Runs under the Hugging Face interpreter (Python 3.11, torch CPU, transformers 5.24; the tests use
``/work/main/.venv-hf/bin/python``), not under jax_dsa's. The job file (first argument, JSON) has:

* ``"build"``: specs ``{name, hf_config, seed, batch, seq_len}``. Each builds
  ``DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config))`` with eager attention, draws every
  parameter and buffer at random (the router's correction bias, the hash layers' ``tid2eid``
  table, sinks and position biases included, which transformers' own init leaves at 0), saves it
  with ``save_pretrained`` to ``<out_dir>/<name>`` and writes ``<out_dir>/<name>.npz`` with
  ``input_ids [B, S]`` and float32 ``logits [B, S, vocab]`` (``torch.no_grad``, no cache).
* ``"load"``: specs ``{name, path, input_ids}``. Each loads ``from_pretrained(path)`` (a folder
  written by ``jax_dsa.interop.save_hf``) and writes ``<out_dir>/<name>.npz`` with ``logits``,
  ``missing_json`` / ``unexpected_json`` (the loading report's keys) and ``mismatched_json``.

Usage: ``python v4_model_reference.py JOB.json OUT_DIR``.
"""

import json
import math
import pathlib
import sys

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def randomize(model, gen):
    """Linear-like weights ~ N(0, 1/fan_in); norm weights ~ 1 + N(0, 0.1); hyper-connection
    scales ~ 1 + N(0, 0.2) and biases ~ N(0, 0.3); position biases ~ N(0, 0.5); sinks and the
    embedding ~ N(0, 1); router correction biases ~ N(0, 0.1); each token's hash experts are
    distinct, drawn at random."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf in ("base", "hc_base"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif leaf == "position_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif leaf == "sinks" or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):
                n_experts = model.config.n_routed_experts
                rows = [torch.randperm(n_experts, generator=gen)[: b.shape[1]]
                        for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows).to(b.dtype))


def build(spec, out_dir):
    config = DeepseekV4Config(**spec["hf_config"])
    config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    model = DeepseekV4ForCausalLM(config).eval()
    randomize(model, gen)
    if config.tie_word_embeddings:
        model.tie_weights()
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq_len"]), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    model.save_pretrained(out_dir / spec["name"])
    np.savez(out_dir / f"{spec['name']}.npz", input_ids=ids.numpy().astype(np.int32),
             logits=logits.float().numpy())


def load(spec, out_dir):
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        spec["path"], output_loading_info=True, attn_implementation="eager",
        dtype=torch.float32)
    model.eval()
    ids = torch.tensor(np.asarray(spec["input_ids"]), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    np.savez(
        out_dir / f"{spec['name']}.npz", logits=logits.float().numpy(),
        missing_json=np.array(json.dumps(sorted(info.get("missing_keys", [])))),
        unexpected_json=np.array(json.dumps(sorted(info.get("unexpected_keys", [])))),
        mismatched_json=np.array(json.dumps([str(m) for m in info.get("mismatched_keys", [])])),
    )


def main():
    job = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out_dir = pathlib.Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    for spec in job.get("build", []):
        build(spec, out_dir)
    for spec in job.get("load", []):
        load(spec, out_dir)
    print("ok", len(job.get("build", [])), len(job.get("load", [])))


if __name__ == "__main__":
    main()
