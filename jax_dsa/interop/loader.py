"""Loading Hugging Face GLM-5 / GLM-5.2 / DeepSeek V3.2 checkpoints into :mod:`jax_dsa.nn`.

The model is first built abstractly (``nnx.eval_shape``: shapes, dtypes and logical axes, no
memory); each parameter is then streamed from the checkpoint, one device slice at a time, by
:func:`jax_dsa.interop.reading.fill_state`, which also dequantises block-scaled FP8 weights
(:class:`jax_dsa.interop.reading.CheckpointSource`).

:func:`load_hf` hands whole DeepSeek V4 checkpoints to :mod:`jax_dsa.interop.v4_lm`,
:func:`load_hf_attention` V4 layers to :mod:`jax_dsa.interop.v4`.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_dsa.configs import DSAConfig
from jax_dsa.configs.v4 import DeepseekV4Config
from jax_dsa.interop.hf_config import config_from_hf, read_hf_config
from jax_dsa.interop.names import hf_key, is_ignored_key
from jax_dsa.interop.reading import CheckpointSource, fill_state
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.interop.v4 import MODEL_TYPE as V4_MODEL_TYPE
from jax_dsa.interop.v4 import load_v4_attention
from jax_dsa.interop.v4_lm import load_v4
from jax_dsa.nn.attention import DSAAttention
from jax_dsa.nn.model import DSALanguageModel
from jax_dsa.nn.v4_model import DeepseekV4LanguageModel


def load_hf_config(path: str | os.PathLike) -> DSAConfig | DeepseekV4Config:
    """The config of a checkpoint directory's ``config.json``: a
    :class:`~jax_dsa.configs.DSAConfig`, or a :class:`~jax_dsa.configs.v4.DeepseekV4Config`
    for ``model_type: "deepseek_v4"`` (see :func:`jax_dsa.interop.config_from_hf`)."""
    return config_from_hf(read_hf_config(path))


def _check_keys(reader, consumed, missing, num_hidden_layers, tied, what):
    if missing:
        raise ValueError(
            f"{what}: the checkpoint lacks {len(missing)} tensors the model needs, e.g. "
            f"{missing[:5]}"
        )
    unexpected = [
        k for k in reader.keys()
        if k not in consumed and not is_ignored_key(k, num_hidden_layers)
        and not (tied and k == "lm_head.weight")
    ]
    if unexpected:
        raise ValueError(
            f"{what}: {len(unexpected)} checkpoint tensors belong to no supported layer, e.g. "
            f"{unexpected[:5]}"
        )


def load_hf(
    path: str | os.PathLike,
    *,
    dtype=jnp.bfloat16,
    compute_dtype=None,
    mesh: Mesh | None = None,
    rules=None,
    mtp: bool | None = None,
) -> DSALanguageModel | DeepseekV4LanguageModel:
    """Load a local Hugging Face GLM-5 / GLM-5.2 / DeepSeek V3.2 / DeepSeek V4 checkpoint.

    DeepSeek V4 (``model_type: "deepseek_v4"``) gives a
    :class:`jax_dsa.nn.v4_model.DeepseekV4LanguageModel`, from any layout
    :func:`jax_dsa.interop.v4_layouts.open_v4_checkpoint` reads (see
    :func:`jax_dsa.interop.v4_lm.load_v4`), with its multi-token-prediction depths per ``mtp``:
    ``None`` (default) builds them when ``num_nextn_predict_layers`` > 0 and the checkpoint holds
    DeepSeek's ``mtp.{k}.*`` tensors (the release, or ``save_hf`` of an MTP model; a
    transformers ``save_pretrained`` folder has none), ``True`` requires them, ``False`` skips
    them. The rest of this docstring is about the others (``mtp`` must stay ``None`` or
    ``False`` for them).

    Reads ``config.json`` (:func:`load_hf_config`) and the safetensors file(s) of ``path``
    (``model.safetensors``, or the shards of ``model.safetensors.index.json``), tensor by tensor.
    MTP layers (``model.layers.N`` with ``N >= num_hidden_layers``) are skipped.

    Args:
      path: checkpoint directory.
      dtype: storage dtype of the parameters (the indexer's ``weights_proj``, its ``k_norm`` and
        the MoE router stay float32, as in transformers).
      compute_dtype: activation / matmul dtype; default ``dtype``.
      mesh: place each parameter straight into its ``NamedSharding`` on this mesh (default: the
        first device).
      rules: ``((logical_axis, mesh_axis_or_None), ...)`` for the parameters' logical axes
        (default: :func:`jax_dsa.sharding.current_rules`, i.e. ``DEFAULT_RULES``: heads, mlp and
        vocab over ``tp``). Rules naming an axis the mesh lacks, or not dividing the dim, are
        skipped (:func:`jax_dsa.sharding.logical_to_spec`).

    Returns:
      A :class:`jax_dsa.nn.DSALanguageModel`; ``logits, aux = model(input_ids, positions=None,
      segment_ids=None)`` gives ``logits [B, S, vocab_size]`` float32 (``aux`` holds the indexer
      training loss). With ``tie_word_embeddings`` the embedding is copied into ``lm_head`` (the
      two are untied from then on).

    Raises:
      FileNotFoundError: no ``config.json`` or no safetensors file.
      ValueError: an unsupported config (:func:`jax_dsa.interop.config_from_hf`), a tensor of the
        wrong shape, tensors missing, or tensors that belong to no supported layer.
    """
    hf = read_hf_config(path)
    if hf.get("model_type") == V4_MODEL_TYPE:
        return load_v4(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules,
                       hf=hf, mtp=mtp)
    if mtp:
        raise ValueError(
            f"load_hf: mtp=True is for DeepSeek V4 checkpoints (model_type {V4_MODEL_TYPE!r}); "
            f"{hf.get('model_type')!r} models are loaded without MTP layers")
    config = config_from_hf(hf)
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    abs_model = nnx.eval_shape(
        lambda: DSALanguageModel(
            config, rngs=nnx.Rngs(0), dtype=compute_dtype, param_dtype=dtype
        )
    )
    graphdef, abs_state = nnx.split(abs_model)
    tied = bool(config.tie_word_embeddings)

    def key_of(p):
        if tied and p == ("lm_head", "weight"):
            return "model.embed_tokens.weight", False
        return hf_key(p)

    with CheckpointReader(path) as reader:
        state, consumed, missing = fill_state(
            abs_state, CheckpointSource(reader, hf), key_of, mesh, rules
        )
        _check_keys(reader, consumed, missing, config.num_hidden_layers, tied, "load_hf")
    return nnx.merge(graphdef, state)


def load_hf_attention(
    path: str | os.PathLike, layer: int, *, dtype=jnp.float32, mesh: Mesh | None = None,
    rules=None,
) -> nnx.State:
    """One layer's attention and indexer parameters (``model.layers.{layer}.self_attn.*``).

    For models that bring their own blocks: the result is the ``nnx.State`` of a
    :class:`jax_dsa.nn.DSAAttention` (HF names: ``q_a_proj.weight``, ..., ``indexer.wq_b.weight``;
    no ``indexer`` on a ``"shared"`` IndexShare layer). Use it as
    ``attn = DSAAttention(load_hf_config(path), layer, rngs=nnx.Rngs(0)); nnx.update(attn,
    state)``, or ``state.to_pure_dict()`` for nested dicts of arrays.

    Args:
      path: checkpoint directory; layer: decoder layer index.
      dtype: storage dtype (``weights_proj`` and ``k_norm`` stay float32); mesh, rules: as in
        :func:`load_hf`.

    DeepSeek V4 checkpoints (``model_type: "deepseek_v4"``) give the state of a
    :class:`jax_dsa.nn.v4_attention.DeepseekV4Attention` instead (transformers' or DeepSeek's
    naming; see :func:`jax_dsa.interop.v4.load_v4_attention`).

    Raises:
      ValueError: ``layer`` out of range, or the layer's tensors missing / of the wrong shape.
    """
    hf = read_hf_config(path)
    if hf.get("model_type") == V4_MODEL_TYPE:
        return load_v4_attention(path, layer, dtype=dtype, mesh=mesh, rules=rules)
    config = config_from_hf(hf)
    if not 0 <= layer < config.num_hidden_layers:
        raise ValueError(
            f"load_hf_attention: layer must be in [0, {config.num_hidden_layers}), got {layer}"
        )
    abs_attn = nnx.eval_shape(
        lambda: DSAAttention(config, layer, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    )
    _, abs_state = nnx.split(abs_attn)
    prefix = f"model.layers.{layer}.self_attn."
    with CheckpointReader(path) as reader:
        state, consumed, missing = fill_state(
            abs_state, CheckpointSource(reader, hf), lambda p: hf_key(p, prefix), mesh, rules
        )
        if missing:
            raise ValueError(
                f"load_hf_attention: the checkpoint lacks layer {layer}'s tensors {missing[:5]}"
            )
        extra = [k for k in reader.keys() if k.startswith(prefix) and k not in consumed]
        if extra:
            raise ValueError(f"load_hf_attention: unknown attention tensors {extra[:5]}")
    return state
