"""Reference outputs of transformers' ``DeepseekV4Attention`` for the jax_dsa parity tests.

Runs under the Hugging Face interpreter (Python 3.11, torch CPU, transformers 5.24; the tests use
``/work/main/.venv-hf/bin/python``), not under jax_dsa's. For each spec in the JSON file given as
the first argument it builds ``DeepseekV4Config(**spec["hf_config"])`` with eager attention, one
``DeepseekV4Attention`` per layer with every parameter drawn at random (sinks and position biases
included, which transformers' own init sets to zero), random hidden states, positions
``arange(S)``, the model's per-type rotary embeddings and sliding-window causal mask, and runs the
forward pass in float32 under ``torch.no_grad``. It writes ``<out_dir>/<spec name>.npz`` with:

* ``config_json``: ``config.to_dict()`` as JSON (what ``DeepseekV4Config.from_hf_dict`` reads),
* ``hidden_states [B, S, hidden]``, ``position_ids [B, S]``,
* ``layers.<i>.<parameter name>``: the layer's ``state_dict`` under transformers' names,
* ``out.<i> [B, S, hidden]``: the attention output,
* ``topk.<i> [B, S, K]``: the CSA indexer's choice (CSA layers; ``-1`` = invalid),
* ``renamed_json``: when the spec lists ``original_names`` (keys in DeepSeek's own checkpoint
  naming), the keys transformers' ``deepseek_v4`` checkpoint conversion turns them into.

Usage: ``python v4_attention_reference.py SPECS.json OUT_DIR``.
"""

import json
import math
import pathlib
import sys

import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
)


def randomize(module, gen):
    """Every parameter random: linear weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1),
    position biases ~ N(0, 0.5), sinks ~ N(0, 1)."""
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif leaf == "position_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif leaf == "sinks":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def run(spec, out_dir):
    config = DeepseekV4Config(**spec["hf_config"])
    config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    b, s = spec["batch"], spec["seq_len"]
    x = torch.randn((b, s, config.hidden_size), generator=gen, dtype=torch.float32)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    rotary = DeepseekV4RotaryEmbedding(config)
    embeddings = {
        t: rotary(x, position_ids=position_ids, layer_type=t) for t in ("main", "compress")
    }
    mask = create_sliding_window_causal_mask(
        config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=position_ids
    )
    if not isinstance(mask, torch.Tensor):
        raise RuntimeError(f"expected a materialised eager mask, got {type(mask)}")
    arrays = {
        "config_json": np.array(json.dumps(config.to_dict(), default=str)),
        "hidden_states": x.numpy(),
        "position_ids": position_ids.numpy().astype(np.int32),
    }
    for i in range(config.num_hidden_layers):
        attn = DeepseekV4Attention(config, i).eval()
        randomize(attn, gen)
        with torch.no_grad():
            out, _ = attn(x, embeddings, position_ids, mask)
            if getattr(attn.compressor, "indexer", None) is not None:
                q_residual = attn.q_a_norm(attn.q_a_proj(x))
                topk = attn.compressor.indexer(x, q_residual, position_ids, None, i)
                arrays[f"topk.{i}"] = topk.numpy().astype(np.int32)
        for name, p in attn.state_dict().items():
            arrays[f"layers.{i}.{name}"] = p.detach().numpy()
        arrays[f"out.{i}"] = out.numpy()
    if spec.get("original_names"):
        mapping = get_checkpoint_conversion_mapping("deepseek_v4")
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        renamed = [rename_source_key(k, renamings, converters)[0] for k in spec["original_names"]]
        arrays["renamed_json"] = np.array(json.dumps(renamed))
    np.savez(pathlib.Path(out_dir) / f"{spec['name']}.npz", **arrays)


def main():
    specs = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out_dir = pathlib.Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    for spec in specs:
        run(spec, out_dir)
    print("ok", len(specs))


if __name__ == "__main__":
    main()
