"""A transformers ``save_pretrained`` DeepSeek V4 checkpoint and its reference attention outputs,
for tests/test_models_deepseek_v4_checkpoint_layouts.py.

Runs under the Hugging Face interpreter (Python 3.11, torch CPU, transformers 5.24), not under
jax_dsa's. Builds ``DeepseekV4ForCausalLM(DeepseekV4Config(**spec["hf_config"]))`` with every
parameter and buffer random (v4_attention_reference.randomize; ``tid2eid`` random expert ids,
``e_score_correction_bias`` random), saves it with ``save_pretrained(OUT_DIR / "hf",
max_shard_size=spec["max_shard_size"])`` exactly as a user would, and writes to ``OUT_DIR``:

* ``state_dict.npz``: ``model.state_dict()`` (the in-memory names and values),
* ``attention.npz``: ``hidden_states [B, S, hidden]``, ``position_ids [B, S]`` and ``out.<i>``,
  the output of ``model.model.layers[i].self_attn`` on them (eager, float32, no_grad, with the
  model's rotary embeddings and sliding-window causal mask),
* ``release_names.json``: ``[saved key, DeepSeek release key, transformers' name]`` per saved
  tensor: the key DeepSeek's release uses for it (``release_name`` below: no ``model.`` prefix,
  ``embed.weight``, ``hc_head_fn``, ``attn.kv_norm.weight``) and the name transformers'
  ``deepseek_v4`` checkpoint conversion (``rename_source_key``) turns that key into.

Usage: ``python v4_checkpoint_reference.py SPEC.json OUT_DIR``.
"""

import json
import pathlib
import sys

import numpy as np
import torch
from safetensors import safe_open
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.masking_utils import create_sliding_window_causal_mask

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from v4_attention_reference import randomize  # noqa: E402


def release_name(key):
    """DeepSeek's release spelling of a save_pretrained key (deepseek-ai/DeepSeek-V4-Flash's
    model.safetensors.index.json)."""
    key = key.removeprefix("model.")
    key = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
           "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(key, key)
    return key.replace(".attn.norm.weight", ".attn.kv_norm.weight")


def main():
    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    out = pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    config = DeepseekV4Config(**spec["hf_config"])
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config).eval()
    randomize(model, gen)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, config.n_routed_experts, buf.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen))
    model.save_pretrained(out / "hf", max_shard_size=spec["max_shard_size"])
    np.savez(out / "state_dict.npz",
             **{k: v.detach().numpy() for k, v in model.state_dict().items()})

    b, s = spec["batch"], spec["seq_len"]
    x = torch.randn((b, s, config.hidden_size), generator=gen, dtype=torch.float32)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)
    rotary = model.model.rotary_emb
    embeddings = {
        t: rotary(x, position_ids=position_ids, layer_type=t) for t in ("main", "compress")
    }
    mask = create_sliding_window_causal_mask(
        config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=position_ids
    )
    arrays = {"hidden_states": x.numpy(), "position_ids": position_ids.numpy().astype(np.int32)}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            arrays[f"out.{i}"] = layer.self_attn(x, embeddings, position_ids, mask)[0].numpy()
    np.savez(out / "attention.npz", **arrays)

    mapping = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    index = out / "hf" / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    keys = []
    for f in files:
        with safe_open(out / "hf" / f, framework="pt") as h:
            keys.extend(h.keys())
    names = [[k, release_name(k), rename_source_key(release_name(k), renamings, converters)[0]]
             for k in keys]
    (out / "release_names.json").write_text(json.dumps(names))
    print("ok", len(keys))


if __name__ == "__main__":
    main()
