"""Loading Hugging Face GLM-5 / GLM-5.2 / DeepSeek V3.2 / DeepSeek V4 checkpoints: the
dispatchers by ``model_type``.

:func:`load_hf` and :func:`load_hf_attention` hand ``"glm_moe_dsa"`` / ``"deepseek_v32"``
checkpoints to :mod:`jax_dsa.models.glm.checkpoint` and ``"deepseek_v4"`` ones to
:mod:`jax_dsa.models.deepseek_v4.checkpoint`. Both build the model abstractly
(``nnx.eval_shape``: shapes, dtypes and logical axes, no memory) and stream each parameter from the
checkpoint, one device slice at a time (:func:`jax_dsa.interop.reading.fill_state` and the V4
reader), dequantising FP8 (and MXFP4) weights on the fly.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jax_dsa.interop.hf_config import V4_MODEL_TYPE, config_from_hf, read_hf_config
from jax_dsa.models.deepseek_v4.checkpoint import load_v4, load_v4_attention
from jax_dsa.models.deepseek_v4.config import DeepseekV4Config
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.models.glm.checkpoint import load_glm, load_glm_attention
from jax_dsa.models.glm.config import DSAConfig
from jax_dsa.models.glm.model import DSALanguageModel


def load_hf_config(path: str | os.PathLike) -> DSAConfig | DeepseekV4Config:
    """The config of a checkpoint directory's ``config.json``: a
    :class:`~jax_dsa.configs.DSAConfig`, or a
    :class:`~jax_dsa.models.deepseek_v4.config.DeepseekV4Config` for ``model_type: "deepseek_v4"``
    (see :func:`jax_dsa.interop.config_from_hf`)."""
    return config_from_hf(read_hf_config(path))


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
    :class:`jax_dsa.models.deepseek_v4.model.DeepseekV4LanguageModel`, from any layout
    :func:`jax_dsa.models.deepseek_v4.checkpoint_layouts.open_v4_checkpoint` reads (see
    :func:`jax_dsa.models.deepseek_v4.checkpoint.load_v4`), with its multi-token-prediction depths
    per ``mtp``: ``None`` (default) builds them when ``num_nextn_predict_layers`` > 0 and the
    checkpoint holds DeepSeek's ``mtp.{k}.*`` tensors (the release, or ``save_hf`` of an MTP model;
    a transformers ``save_pretrained`` folder has none), ``True`` requires them, ``False`` skips
    them. The rest of this docstring is about the others (``mtp`` must stay ``None`` or ``False``
    for them).

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
        wrong shape, tensors missing, or tensors that belong to no supported layer; a damaged
        ``config.json``, index or safetensors file, an integer or bool tensor for a float
        parameter, or a V4 ``tid2eid`` with an expert id out of range (each naming the file;
        ``docs/failure_behaviour.md``). A checkpoint that a killed :func:`save_hf` was replacing
        loads whole, old or new (that module's "Crash safety").
    """
    hf = read_hf_config(path)
    if hf.get("model_type") == V4_MODEL_TYPE:
        return load_v4(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules,
                       hf=hf, mtp=mtp)
    if mtp:
        raise ValueError(
            f"load_hf: mtp=True is for DeepSeek V4 checkpoints (model_type {V4_MODEL_TYPE!r}); "
            f"{hf.get('model_type')!r} models are loaded without MTP layers")
    return load_glm(path, dtype=dtype, compute_dtype=compute_dtype, mesh=mesh, rules=rules,
                    hf=hf, config=config_from_hf(hf))


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
    :class:`jax_dsa.models.deepseek_v4.attention.DeepseekV4Attention` instead (transformers' or
    DeepSeek's naming; see :func:`jax_dsa.models.deepseek_v4.checkpoint.load_v4_attention`).

    Raises:
      ValueError: ``layer`` out of range, or the layer's tensors missing / of the wrong shape.
    """
    hf = read_hf_config(path)
    if hf.get("model_type") == V4_MODEL_TYPE:
        return load_v4_attention(path, layer, dtype=dtype, mesh=mesh, rules=rules)
    return load_glm_attention(path, layer, dtype=dtype, mesh=mesh, rules=rules, hf=hf,
                              config=config_from_hf(hf))
