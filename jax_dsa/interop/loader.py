"""Loading Hugging Face GLM-5 / GLM-5.2 / DeepSeek V3.2 checkpoints into :mod:`jax_dsa.nn`.

The model is first built abstractly (``nnx.eval_shape``: shapes, dtypes and logical axes, no
memory); each parameter is then read from the checkpoint and placed with
``jax.make_array_from_callback``, which asks for one device's slice at a time. Host memory thus
holds one device slice of one tensor at a time (plus the memory map of the shard it comes from),
never the checkpoint. Routed experts, stored one tensor per expert, are stacked slice by slice.

Block-scaled FP8 weights (``quantization_config.quant_method == "fp8"``: ``F8_E4M3`` tensors with
``weight_scale_inv [ceil(out / b0), ceil(in / b1)]``, as in DeepSeek V3.2's release) are
dequantised on the fly: ``w = w_fp8 * weight_scale_inv[i // b0, j // b1]`` (DeepSeek-V3
``inference/fp8_cast_bf16.py`` / ``kernel.py weight_dequant``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jax_dsa.configs import DSAConfig
from jax_dsa.interop.hf_config import config_from_hf, read_hf_config
from jax_dsa.interop.names import expert_keys, hf_key, is_ignored_key
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.nn.attention import DSAAttention
from jax_dsa.nn.model import DSALanguageModel
from jax_dsa.sharding.rules import current_rules, logical_to_spec

SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)


def load_hf_config(path: str | os.PathLike) -> DSAConfig:
    """The :class:`~jax_dsa.configs.DSAConfig` of a checkpoint directory's ``config.json``
    (see :func:`jax_dsa.interop.config_from_hf`)."""
    return config_from_hf(read_hf_config(path))


class _Source:
    """Reads (and dequantises) checkpoint tensors by key."""

    def __init__(self, reader: CheckpointReader, hf: dict):
        self.reader = reader
        quant = hf.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size") or DEFAULT_FP8_BLOCK)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(key)

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        r = self.reader
        if not r.dtype(key).startswith("F8"):
            return r.read(key, index)
        scale_key = key + SCALE_SUFFIX
        if scale_key not in r or len(r.shape(key)) != 2:
            raise ValueError(
                f"load_hf: {key} is FP8 ({r.dtype(key)}) without a 2-D block scale {scale_key}"
            )
        w = r.read(key, index).astype(np.float32)
        shape = r.shape(key)
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index, shape, strict=True))
        b0, b1 = self.block
        want = (-(-shape[0] // b0), -(-shape[1] // b1))
        if r.shape(scale_key) != want:
            raise ValueError(
                f"load_hf: {scale_key} has shape {r.shape(scale_key)}, expected {want} for "
                f"{shape} in blocks of {self.block}"
            )
        scale = r.read(scale_key, (slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1))))
        rows = np.arange(r0, r1) // b0 - r0 // b0
        cols = np.arange(c0, c1) // b1 - c0 // b1
        return w * scale.astype(np.float32)[rows[:, None], cols[None, :]]

    def consumed(self, key: str) -> list[str]:
        extra = key + SCALE_SUFFIX
        return [key, extra] if extra in self.reader else [key]


def _fill(abs_state: nnx.State, source: _Source, key_of: Callable, mesh: Mesh | None,
          rules) -> tuple[nnx.State, set[str], list[str]]:
    """Read every variable of ``abs_state``; returns the filled state, the consumed keys and the
    missing keys."""
    rules = tuple(current_rules() if rules is None else rules)
    single = SingleDeviceSharding(jax.devices()[0])
    consumed: set[str] = set()
    missing: list[str] = []
    flat = []
    for path, var in nnx.to_flat_state(abs_state):
        abstract = var.get_value()
        shape, dtype = tuple(abstract.shape), abstract.dtype
        key, stacked = key_of(path)
        keys = expert_keys(key, shape[0]) if stacked else [key]
        absent = [k for k in keys if k not in source.reader]
        if absent:
            missing.extend(absent)
            continue
        want = shape[1:] if stacked else shape
        for k in keys:
            if source.shape(k) != want:
                raise ValueError(
                    f"load_hf: {k} has shape {source.shape(k)} in the checkpoint, the model "
                    f"expects {want}"
                )
            consumed.update(source.consumed(k))
        if mesh is None:
            sharding = single
        else:
            axes = var.get_metadata().get("out_sharding") or (None,) * len(shape)
            sharding = NamedSharding(mesh, logical_to_spec(axes, rules, mesh, shape))
        np_dtype = np.dtype(dtype)

        def callback(index, keys=keys, stacked=stacked, shape=shape, np_dtype=np_dtype):
            index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
            if not stacked:
                return source.read(keys[0], index).astype(np_dtype)
            experts = range(*index[0].indices(shape[0]))
            return np.stack([source.read(keys[e], index[1:]).astype(np_dtype) for e in experts])

        value = jax.make_array_from_callback(shape, sharding, callback)
        flat.append((path, var.replace(value)))
    return nnx.from_flat_state(flat), consumed, missing


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
) -> DSALanguageModel:
    """Load a local Hugging Face GLM-5 / GLM-5.2 / DeepSeek V3.2 checkpoint.

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
        state, consumed, missing = _fill(
            abs_state, _Source(reader, hf), key_of, mesh, rules
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
    if hf.get("model_type") == "deepseek_v4":
        from jax_dsa.interop.v4 import load_v4_attention  # imports this module

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
        state, consumed, missing = _fill(
            abs_state, _Source(reader, hf), lambda p: hf_key(p, prefix), mesh, rules
        )
        if missing:
            raise ValueError(
                f"load_hf_attention: the checkpoint lacks layer {layer}'s tensors {missing[:5]}"
            )
        extra = [k for k in reader.keys() if k.startswith(prefix) and k not in consumed]
        if extra:
            raise ValueError(f"load_hf_attention: unknown attention tensors {extra[:5]}")
    return state
