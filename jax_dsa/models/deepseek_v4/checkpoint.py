"""Whole DeepSeek V4 models <-> checkpoints (:func:`jax_dsa.interop.load_hf` / ``save_hf`` for
``model_type: "deepseek_v4"``).

The canonical tensor names are those of transformers 5.24's ``DeepseekV4ForCausalLM.state_dict()``.
A state path of :class:`jax_dsa.models.deepseek_v4.model.DeepseekV4LanguageModel` is its
``state_dict`` name without the ``model.`` prefix (``lm_head`` has none), except for the routed
experts: jax_dsa keeps ``experts.gate_proj`` and ``experts.up_proj [E, I, H]`` apart (so that each
splits over the ``mlp`` axis on its own), transformers fuses them as
``experts.gate_up_proj [E, 2 * I, H]`` (gate rows first). :func:`state_dict_name` is that map.

The on-disk layouts (transformers' ``save_pretrained`` output, DeepSeek's release naming, FP8 /
MXFP4 weights) are presented under ``state_dict`` names by
:func:`jax_dsa.models.deepseek_v4.checkpoint_layouts.open_v4_checkpoint`; :func:`save_v4` writes the
layout transformers' ``save_pretrained`` writes
(:func:`jax_dsa.models.deepseek_v4.checkpoint_layouts.save_pretrained_parts`). Reading streams one
device slice of one tensor at a time, as the GLM-5 loader does.

Multi-token prediction: the MTP depths of ``DeepseekV4LanguageModel(..., mtp=True)`` (state paths
``mtp.{k}.*``, names ``model.mtp.{k}.*``) are read from and written as DeepSeek's release keys
``mtp.{k}.*`` (FP8 / MXFP4 ones dequantised as every other tensor); transformers 5.24 has no MTP
module, skips those keys on load and writes none.

One attention layer: :class:`jax_dsa.models.deepseek_v4.attention.DeepseekV4Attention` keeps
transformers' module names, so a parameter's ``state_dict`` name is its state path joined by dots
after ``model.layers.{i}.self_attn.``. :func:`load_v4_attention` reads those names through
:func:`~jax_dsa.models.deepseek_v4.checkpoint_layouts.open_v4_checkpoint` as :func:`load_v4`
does. :data:`ORIGINAL_NAMES` maps the attention parameters to DeepSeek's names exactly as
transformers' ``deepseek_v4`` checkpoint conversion does (``conversion_mapping.py``, transformers
5.24; checked against it by tests/test_models_deepseek_v4_attention.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jax_dsa.interop.hf_config import config_to_hf, read_hf_config
from jax_dsa.interop import reading
from jax_dsa.interop.reading import fill_state
from jax_dsa.interop.safetensors_io import CheckpointWriter, host_array, tied_lm_head
from jax_dsa.models.deepseek_v4.attention import DeepseekV4Attention
from jax_dsa.models.deepseek_v4.checkpoint_layouts import (
    LAYER_NAMES,
    MODEL_TYPE,
    is_mtp_name,
    open_v4_checkpoint,
    save_pretrained_parts,
)
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.sharding.rules import current_rules, logical_to_spec

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_HALVES = {"gate_proj": 0, "up_proj": 1}


def state_dict_name(path: Sequence) -> tuple[str, int | None]:
    """The ``state_dict`` name of a model state path, and for the split routed experts which
    half of the fused tensor it is.

    Example: ``("layers", 3, "mlp", "experts", "up_proj")`` ->
    ``("model.layers.3.mlp.experts.gate_up_proj", 1)`` (rows ``I .. 2 I - 1``);
    ``("hc_head", "hc_fn")`` -> ``("model.hc_head.hc_fn", None)``; an MTP depth's
    ``("mtp", 0, "self_attn", "q_a_proj", "weight")`` ->
    ``("model.mtp.0.self_attn.q_a_proj.weight", None)`` (jax_dsa's name: transformers has none).
    """
    parts = [str(p) for p in path]
    if parts[0] == "lm_head":
        return ".".join(parts), None
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in _HALVES:
        return "model." + ".".join(parts[:-1]) + ".gate_up_proj", _HALVES[parts[-1]]
    return "model." + ".".join(parts), None


def _fused_shape(shape, half):
    return tuple(shape) if half is None else (shape[0], 2 * shape[1], *shape[2:])


def _want_mtp(mtp: bool | None, n_depths: int, ckpt) -> bool:
    """Whether to build (and read) the MTP depths; see :func:`load_v4`'s ``mtp``."""
    present = ckpt.mtp_keys()
    if mtp is None:
        return n_depths > 0 and bool(present)
    if mtp and n_depths < 1:
        raise ValueError(
            "load_hf: mtp=True but the config's num_nextn_predict_layers is 0 (no MTP depths to "
            "build)")
    if mtp and not present:
        raise ValueError(
            f"load_hf: mtp=True but the checkpoint ({ckpt.layout} layout) holds no MTP tensors "
            "(DeepSeek's release keys mtp.{k}.*; transformers' save_pretrained writes none)")
    return bool(mtp)


def load_v4(path: str | os.PathLike, *, dtype=jnp.bfloat16, compute_dtype=None,
            mesh: Mesh | None = None, rules=None, hf: dict | None = None,
            mtp: bool | None = None) -> DeepseekV4LanguageModel:
    """A :class:`~jax_dsa.models.deepseek_v4.model.DeepseekV4LanguageModel` with a checkpoint's
    weights.

    Args:
      path: checkpoint directory (``config.json`` with ``model_type: "deepseek_v4"``; any layout
        :func:`~jax_dsa.models.deepseek_v4.checkpoint_layouts.open_v4_checkpoint` reads).
      dtype: storage dtype of the projections, experts, embedding and LM head (the
        hyper-connections, norms, routers, sinks and position biases stay float32).
      compute_dtype: activation / matmul dtype (default ``dtype``).
      mesh, rules: as in :func:`jax_dsa.interop.load_hf`.
      hf: the ``config.json`` dict, if already read.
      mtp: the multi-token-prediction depths (``DeepseekV4LanguageModel(..., mtp=True)``, read
        from the release keys ``mtp.{k}.*``). ``None`` (default): built when the config's
        ``num_nextn_predict_layers`` > 0 and the checkpoint holds MTP tensors (DeepSeek's
        release, or :func:`save_v4` of an MTP model), else not (a transformers
        ``save_pretrained`` folder has none). ``True``: required (every depth's every tensor).
        ``False``: not built, the checkpoint's MTP tensors skipped (as transformers does).

    Returns:
      The model. With ``tie_word_embeddings`` the embedding is copied into ``lm_head``.

    Raises:
      ValueError: not a V4 config, a tensor of the wrong shape, tensors missing (MTP ones
        included when MTP is built), tensors that are no parameter of the model (with MTP built:
        also ``mtp.{k}.*`` keys of a depth ``k >= num_nextn_predict_layers`` or that are no MTP
        tensor), ``mtp=True`` with ``num_nextn_predict_layers == 0`` or a checkpoint without
        MTP tensors, or a checkpoint ``open_v4_checkpoint`` refuses.
    """
    hf = read_hf_config(path) if hf is None else hf
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"load_v4: model_type must be {MODEL_TYPE!r}, got "
                         f"{hf.get('model_type')!r}")
    config = DeepseekV4Config.from_hf_dict(hf)
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    tied = bool(config.tie_word_embeddings)
    rules = tuple(current_rules() if rules is None else rules)
    single = SingleDeviceSharding(jax.devices()[0])
    used, missing, flat = set(), [], []
    with open_v4_checkpoint(path, hf) as ckpt:
        build_mtp = _want_mtp(mtp, config.num_nextn_predict_layers, ckpt)
        abs_model = nnx.eval_shape(lambda: DeepseekV4LanguageModel(
            config, rngs=nnx.Rngs(0), dtype=compute_dtype, param_dtype=dtype, mtp=build_mtp))
        graphdef, abs_state = nnx.split(abs_model)
        for p, var in nnx.to_flat_state(abs_state):
            abstract = var.get_value()
            shape, np_dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
            name, half = state_dict_name(p)
            if tied and name == LM_HEAD:
                name = EMBED
            if name not in ckpt:
                missing.append(name)
                continue
            if ckpt.shape(name) != _fused_shape(shape, half):
                raise ValueError(
                    f"load_hf: {name} has shape {ckpt.shape(name)} in the checkpoint, the model "
                    f"expects {_fused_shape(shape, half)}"
                )
            used.add(name)
            reading.check_tensor_dtype(ckpt, name, np_dtype)  # no int/bool float weights
            if name.endswith("tid2eid"):  # expert ids in range: no NaN logits
                reading.check_expert_ids(ckpt, name, config.n_routed_experts)
            if mesh is None:
                sharding = single
            else:
                axes = var.get_metadata().get("out_sharding") or (None,) * len(shape)
                sharding = NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))

            def callback(index, name=name, half=half, shape=shape, np_dtype=np_dtype):
                index = [slice(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
                if half:  # the up rows follow the gate rows
                    off = shape[1]
                    index[1] = slice(index[1].start + off, index[1].stop + off)
                return np.asarray(ckpt.read(name, tuple(index))).astype(np_dtype)

            flat.append((p, var.replace(jax.make_array_from_callback(shape, sharding, callback))))
        if missing:
            hint = ""
            if any(is_mtp_name(n) for n in missing):
                hint = (" (MTP tensors are read from DeepSeek's release keys mtp.{k}.*, e.g. "
                        "mtp.0.e_proj.weight for model.mtp.0.e_proj.weight; mtp=False loads "
                        "the model without them)")
            raise ValueError(
                f"load_hf: the checkpoint ({ckpt.layout} layout) lacks {len(missing)} tensors the "
                f"model needs, e.g. {sorted(set(missing))[:5]}{hint}"
            )
        extra = [k for k in ckpt.keys() if k not in used and not (tied and k == LM_HEAD)]
        extra += list(ckpt.unknown)
        if build_mtp:  # else the MTP tensors are skipped, as transformers does
            extra += [k for k in ckpt.mtp_keys() if k not in used] + list(ckpt.ignored)
        if extra:
            raise ValueError(
                f"load_hf: {len(extra)} checkpoint tensors belong to no parameter of the model, "
                f"e.g. {extra[:5]}"
            )
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save_v4(model: DeepseekV4LanguageModel, path: str | os.PathLike, *,
            max_shard_size: int | str = "5GB", dtype_name: str | None = None,
            layout: str = "save_pretrained") -> list[str]:
    """Write ``model`` in transformers' ``save_pretrained`` layout (``config.json`` and
    safetensors shards); transformers' ``DeepseekV4ForCausalLM.from_pretrained`` rebuilds the
    same model.

    Parameters are written in their own dtype (``tid2eid`` as int64, as transformers holds it),
    fetched to the host one at a time (one expert at a time for the routed experts).
    ``layout="deepseek"`` writes DeepSeek's release names instead (``layers.N.attn.wq_a.weight``,
    ``embed.weight``, ...;
    :func:`~jax_dsa.models.deepseek_v4.checkpoint_layouts.save_pretrained_parts`), with
    transformers' ``config.json``. The MTP depths of an ``mtp=True`` model are written under the
    release's keys in both layouts (``mtp.{k}.attn.wq_a.weight``, ``mtp.{k}.e_proj.weight``,
    ``mtp.{k}.hc_head_fn``, ``mtp.{k}.ffn.experts.{e}.w1.weight``, ...), which :func:`load_v4` reads
    back and transformers skips (``_keys_to_ignore_on_load_unexpected``); ``config.json`` keeps
    ``num_nextn_predict_layers``. ``layout="state_dict"`` writes ``model.mtp.{k}.*``.

    Raises:
      TypeError: ``model`` is not a ``DeepseekV4LanguageModel``.
      ValueError: ``tie_word_embeddings`` with an ``lm_head`` that differs from the embedding, or
        parameters not addressable from this process.
    """
    if not isinstance(model, DeepseekV4LanguageModel):
        raise TypeError(
            f"save_hf: model must be a DeepseekV4LanguageModel, got {type(model).__name__}")
    config = model.config
    path = os.fspath(path)
    hf = config_to_hf(config, dtype=dtype_name)
    if model.mtp is not None:  # config_to_hf writes 0: the depths saved here
        hf["num_nextn_predict_layers"] = len(model.mtp)
    tied = tied_lm_head(model)
    _, state = nnx.split(model)
    values = {}
    for p, var in nnx.to_flat_state(state):
        name, half = state_dict_name(p)
        if tied and name == LM_HEAD:
            continue
        values.setdefault(name, {})[half] = var.get_value()
    os.makedirs(path, exist_ok=True)
    writer = CheckpointWriter(path, max_shard_size)
    for name, by_half in values.items():
        if None in by_half:
            value = by_half[None]
            shape = value.shape
        else:
            shape = _fused_shape(by_half[0].shape, 0)
        for key, index in save_pretrained_parts(name, shape, layout):
            if None in by_half:
                array = host_array(value[index] if index else value)
                if name.endswith("tid2eid"):
                    array = array.astype(np.int64)
            elif not index:  # layout="state_dict": the fused tensor whole, gate rows first
                array = np.concatenate([host_array(by_half[0]), host_array(by_half[1])], axis=1)
            else:  # index = (expert, rows) of the fused tensor: one half, one expert
                e, rows = index
                i = by_half[0].shape[1]
                h = rows.start // i
                array = host_array(by_half[h][e, rows.start - h * i:rows.stop - h * i])
            writer.add(key, array)
    return writer.finish(config=hf)  # config.json committed with the weights, atomically


# transformers' parameter name (relative to self_attn) -> DeepSeek's (relative to attn).
ORIGINAL_NAMES: dict[str, str] = {
    name.removeprefix("self_attn."): disk[1].removeprefix("attn.")
    for name, disk in LAYER_NAMES.items() if name.startswith("self_attn.")
}


def attention_prefix(layer: int, original: bool = False) -> str:
    """``model.layers.{layer}.self_attn.`` (transformers) or ``layers.{layer}.attn.`` (DeepSeek)."""
    return f"layers.{layer}.attn." if original else f"model.layers.{layer}.self_attn."


def attention_key(path, layer: int, original: bool = False) -> str:
    """The checkpoint key of a :class:`DeepseekV4Attention` state path (e.g.
    ``("compressor", "indexer", "q_b_proj", "weight")``) in either naming.

    Raises:
      KeyError: a path that is not a V4 attention parameter (DeepSeek naming only).
    """
    name = ".".join(str(p) for p in path)
    if original:
        name = ORIGINAL_NAMES[name]
    return attention_prefix(layer, original) + name


def load_v4_attention(
    path: str | os.PathLike, layer: int, *, dtype=jnp.float32, mesh: Mesh | None = None,
    rules=None,
) -> nnx.State:
    """One DeepSeek V4 layer's attention parameters (with its compressor and indexer).

    The result is the ``nnx.State`` of a
    :class:`jax_dsa.models.deepseek_v4.attention.DeepseekV4Attention`: ``attn =
    DeepseekV4Attention(DeepseekV4Config.from_hf_dict(read_hf_config(path)), layer,
    rngs=nnx.Rngs(0)); nnx.update(attn, state)``. The layout (transformers' ``save_pretrained``,
    DeepSeek's release, or ``state_dict`` names) and the quantisation are detected from the
    checkpoint (:func:`jax_dsa.models.deepseek_v4.checkpoint_layouts.open_v4_checkpoint`).

    Args:
      path: checkpoint directory (``config.json`` with ``model_type: "deepseek_v4"`` and
        safetensors files).
      layer: decoder layer index.
      dtype: storage dtype (sinks, position biases and norms stay float32).
      mesh, rules: as in :func:`jax_dsa.interop.load_hf`.

    Raises:
      ValueError: not a DeepSeek V4 config, ``layer`` out of range, the layer's tensors missing
        or of the wrong shape, unknown tensors under the layer's attention prefix, or a
        checkpoint :func:`~jax_dsa.models.deepseek_v4.checkpoint_layouts.open_v4_checkpoint` refuses
        (unsupported quantisation, named).
    """
    hf = read_hf_config(path)
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"load_v4_attention: model_type must be {MODEL_TYPE!r}, got {hf.get('model_type')!r}"
        )
    config = DeepseekV4Config.from_hf_dict(hf)
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(
            f"load_v4_attention: layer must be in [0, {config.num_hidden_layers}), got {layer}"
        )
    abs_attn = nnx.eval_shape(
        lambda: DeepseekV4Attention(config, layer, rngs=nnx.Rngs(0), dtype=dtype,
                                    param_dtype=dtype)
    )
    _, abs_state = nnx.split(abs_attn)
    prefix = attention_prefix(layer)
    with open_v4_checkpoint(path, hf) as ckpt:
        state, consumed, missing = fill_state(
            abs_state, ckpt, lambda p: (attention_key(p, layer), False), mesh, rules
        )
        if missing:
            raise ValueError(
                f"load_v4_attention: the checkpoint ({ckpt.layout} layout) lacks layer {layer}'s "
                f"tensors {missing[:5]}"
            )
        extra = [k for k in ckpt.keys() if k.startswith(prefix) and k not in consumed]
        layer_keys = (f"layers.{layer}.attn.", f"model.layers.{layer}.attn.", prefix)
        extra += [k for k in ckpt.unknown if k.startswith(layer_keys)]
        if extra:
            raise ValueError(f"load_v4_attention: unknown attention tensors {extra[:5]}")
    return state


__all__ = [
    "ORIGINAL_NAMES", "attention_key", "attention_prefix", "load_v4", "load_v4_attention",
    "save_v4", "state_dict_name",
]
