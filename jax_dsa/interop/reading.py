"""Streaming a checkpoint's tensors into an abstract ``nnx.State``: shared by every loader.

:func:`fill_state` takes the abstract state of a model built with ``nnx.eval_shape`` (shapes,
dtypes and logical axes, no memory) and places each variable with
``jax.make_array_from_callback``, which asks for one device's slice at a time. Host memory thus
holds one device slice of one tensor at a time (plus the memory map of the shard it comes from),
never the checkpoint. Routed experts, stored one tensor per expert, are stacked slice by slice.

:class:`CheckpointSource` reads those slices from a
:class:`~jax_dsa.interop.safetensors_io.CheckpointReader` and dequantises block-scaled FP8
weights (``quantization_config.quant_method == "fp8"``: ``F8_E4M3`` tensors with
``weight_scale_inv [ceil(out / b0), ceil(in / b1)]``, as in DeepSeek V3.2's release) on the fly:
``w = w_fp8 * weight_scale_inv[i // b0, j // b1]`` (DeepSeek-V3 ``inference/fp8_cast_bf16.py`` /
``kernel.py weight_dequant``).

The GLM / V3.2 loader (:mod:`jax_dsa.interop.loader`) and the DeepSeek V4 one
(:mod:`jax_dsa.interop.v4`) differ only in the model they build and in ``key_of``, the map from a
state path to a checkpoint key.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jax_dsa.interop.names import expert_keys
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.sharding.rules import current_rules, logical_to_spec

SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)


class CheckpointSource:
    """Reads checkpoint tensors, or slices of them, by key, dequantising block-scaled FP8.

    Args:
      reader: an open :class:`~jax_dsa.interop.safetensors_io.CheckpointReader`.
      hf: the checkpoint's ``config.json`` dict; its ``quantization_config.weight_block_size``
        gives the FP8 block (default :data:`DEFAULT_FP8_BLOCK`).
    """

    def __init__(self, reader: CheckpointReader, hf: dict):
        self.reader = reader
        quant = hf.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size") or DEFAULT_FP8_BLOCK)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(key)

    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]``; an FP8 tensor comes back float32, times its block scales.

        Raises:
          ValueError: an FP8 tensor without a 2-D ``{key}_scale_inv`` of the block grid's shape.
        """
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
        """The checkpoint keys that reading ``key`` uses: itself and its FP8 scale, if any."""
        extra = key + SCALE_SUFFIX
        return [key, extra] if extra in self.reader else [key]


def fill_state(abs_state: nnx.State, source: CheckpointSource, key_of: Callable,
               mesh: Mesh | None, rules) -> tuple[nnx.State, set[str], list[str]]:
    """Read every variable of ``abs_state`` from ``source``.

    Args:
      abs_state: the abstract state (``nnx.split(nnx.eval_shape(...))[1]``).
      source: where the tensors come from.
      key_of: state path -> ``(checkpoint key, stacked)``; ``stacked`` means the variable's
        leading axis is the routed experts, stored one tensor per expert
        (:func:`jax_dsa.interop.names.expert_keys`).
      mesh: place each variable in the ``NamedSharding`` of its logical axes on this mesh
        (``None``: the first device).
      rules: logical-axis rules (``None``: :func:`jax_dsa.sharding.current_rules`).

    Returns:
      ``(state, consumed, missing)``: the filled state (variables whose keys are missing are left
      out), the checkpoint keys read, and the keys the model needs that the checkpoint lacks.

    Raises:
      ValueError: a checkpoint tensor whose shape is not the variable's.
    """
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


__all__ = ["DEFAULT_FP8_BLOCK", "SCALE_SUFFIX", "CheckpointSource", "fill_state"]
