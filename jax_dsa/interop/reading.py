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
``kernel.py weight_dequant``). The block-scale helpers (:func:`block_scales`, :func:`scale_values`,
:func:`dequantize_fp8_block`) also serve :mod:`jax_dsa.models.deepseek_v4.checkpoint_layouts`, which
adds DeepSeek V4's ``.scale`` naming, UE8M0 scales and MXFP4 experts.

The GLM / V3.2 loader (:mod:`jax_dsa.models.glm.checkpoint`) and the DeepSeek V4 one
(:mod:`jax_dsa.models.deepseek_v4.checkpoint`) differ only in the model they build and in ``key_of``, the map from a
state path to a checkpoint key.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
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
        return dequantize_fp8_block(r, key, scale_key, index, self.block)

    def consumed(self, key: str) -> list[str]:
        """The checkpoint keys that reading ``key`` uses: itself and its FP8 scale, if any."""
        extra = key + SCALE_SUFFIX
        return [key, extra] if extra in self.reader else [key]


def scale_values(scale: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """Block scales as float32, from a safetensors dtype name.

    ``F32`` / ``BF16`` / ``F16`` are values; ``F8_E8M0`` (UE8M0, ``scale_fmt: "ue8m0"``) is a
    power of two ``2 ** (byte - 127)`` (OCP Microscaling Formats v1.0, section 5.4); ``U8`` holds
    the same exponent bytes untyped (as transformers' ``Fp8Dequantize`` reads them).

    Raises:
      ValueError: another dtype (``what`` names the tensor).
    """
    if dtype in ("F32", "BF16", "F16", "F8_E8M0"):
        return np.asarray(scale).astype(np.float32)
    if dtype == "U8":
        return np.asarray(scale).view(jnp.float8_e8m0fnu).astype(np.float32)
    raise ValueError(f"{what}: block scales must be F32, BF16, F16, F8_E8M0 or U8, got {dtype}")


def block_scales(read_scale: Callable, scale_shape: tuple[int, int], shape: tuple[int, int],
                 index: tuple[slice, slice], block: tuple[int, int], what: str) -> np.ndarray:
    """The per-element scales of ``tensor[index]`` for scales over ``block = (b0, b1)`` tiles:
    element ``(i, j)`` takes ``scale[i // b0, j // b1]`` (the grid is
    ``[ceil(rows / b0), ceil(cols / b1)]``; edge tiles are partial).

    Args:
      read_scale: ``(row_slice, col_slice) -> float32 array`` of the scale grid.
      scale_shape: the grid's shape; shape: the tensor's (logical) shape; index: two slices
        (step 1); block: the tile; what: the tensor's name for errors.

    Raises:
      ValueError: a grid of another shape.
    """
    b0, b1 = block
    want = (-(-shape[0] // b0), -(-shape[1] // b1))
    if tuple(scale_shape) != want:
        raise ValueError(
            f"load_hf: the scale of {what} has shape {tuple(scale_shape)}, expected {want} for "
            f"{tuple(shape)} in blocks of {tuple(block)}"
        )
    (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index, shape, strict=True))
    scale = read_scale(slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1)))
    rows = np.arange(r0, r1) // b0 - r0 // b0
    cols = np.arange(c0, c1) // b1 - c0 // b1
    return scale[rows[:, None], cols[None, :]]


def dequantize_fp8_block(reader: CheckpointReader, key: str, scale_key: str,
                         index: tuple[slice, slice], block: tuple[int, int]) -> np.ndarray:
    """``w[index]`` of a block-scaled FP8 weight, float32: ``w_fp8 * scale[i // b0, j // b1]``
    (DeepSeek-V3 ``inference/kernel.py weight_dequant``; ``scale`` is ``weight_scale_inv`` in
    transformers' naming, ``.scale`` in DeepSeek V4's, F32 or UE8M0: :func:`scale_values`).

    Raises:
      ValueError: a scale grid of the wrong shape or dtype.
    """
    shape = reader.shape(key)
    scale_dtype = reader.dtype(scale_key)

    def read_scale(rows, cols):
        return scale_values(reader.read(scale_key, (rows, cols)), scale_dtype, scale_key)

    w = reader.read(key, index).astype(np.float32)
    return w * block_scales(read_scale, reader.shape(scale_key), shape, index, block, key)


def _kind(dtype) -> str:
    """``"float"``, ``"int"`` or ``"bool"`` of a safetensors dtype name or a NumPy dtype
    (``ml_dtypes``' bfloat16 and FP8 are floats)."""
    if isinstance(dtype, str):
        return "bool" if dtype == "BOOL" else ("int" if dtype[:1] in ("I", "U") else "float")
    return {"b": "bool", "i": "int", "u": "int"}.get(np.dtype(dtype).kind, "float")


def file_of(reader, key: str) -> str:
    """The file that holds ``key`` of a :class:`CheckpointReader` or of a reader that presents
    other readers' tensors (DeepSeek V4's ``V4Checkpoint``), for errors."""
    if hasattr(reader, "file_of"):
        return reader.file_of(key)
    inner, disk_keys = getattr(reader, "_reader", None), getattr(reader, "disk_keys", None)
    if inner is not None and disk_keys is not None:
        return inner.file_of(disk_keys(key)[0])
    return getattr(reader, "path", "?")


def _named(reader, key: str) -> str:
    """``key`` and the file that holds it, with its on-disk name where the reader renames."""
    disk = reader.disk_keys(key)[0] if hasattr(reader, "disk_keys") else key
    return f"{key}{f' (stored as {disk})' if disk != key else ''} in {file_of(reader, key)}"


def check_tensor_dtype(reader, key: str, want) -> None:
    """Refuses to load a checkpoint tensor into a variable of another kind: an integer or bool
    tensor (unscaled: a quantised weight's scale turns it into floats before this) into a float
    parameter, or a float or bool tensor into an integer one (an index table).

    Raises:
      ValueError: naming the tensor, its file, its dtype and the dtype expected.
    """
    stored, want = reader.dtype(key), np.dtype(want)
    got_kind, want_kind = _kind(stored), _kind(want)
    if got_kind == want_kind:
        return
    name = getattr(stored, "name", stored)
    if want_kind == "float":
        raise ValueError(
            f"load_hf: {_named(reader, key)} is {name} ({got_kind}); the model's parameter is "
            f"{want.name}: integer and bool tensors are refused as float weights (a quantised "
            "weight needs its scale tensor)")
    raise ValueError(
        f"load_hf: {_named(reader, key)} is {name} ({got_kind}); the model expects an "
        f"{want_kind} tensor ({want.name})")


def check_expert_ids(reader, key: str, n_experts: int) -> None:
    """Refuses a hash-routing table (DeepSeek V4's ``tid2eid``: token -> expert ids) holding an
    id outside ``[0, n_experts)``, which would route tokens to no expert (NaN logits).

    Raises:
      ValueError: naming the tensor, its file, the range and the first bad entry.
    """
    table = np.asarray(reader.read(key))
    bad = (table < 0) | (table >= n_experts)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"load_hf: {_named(reader, key)} must hold expert ids in [0, {n_experts}) "
            f"(n_routed_experts); {int(bad.sum())} entries do not, e.g. {table[where]} at "
            f"{where} (min {table.min()}, max {table.max()})")


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
      ValueError: a checkpoint tensor whose shape is not the variable's, or an integer / bool
        tensor for a float variable or a float one for an integer variable
        (:func:`check_tensor_dtype`).
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
            check_tensor_dtype(source.reader, k, dtype)
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


__all__ = [
    "DEFAULT_FP8_BLOCK", "SCALE_SUFFIX", "CheckpointSource", "block_scales", "check_expert_ids",
    "check_tensor_dtype", "dequantize_fp8_block", "file_of", "fill_state", "scale_values",
]
