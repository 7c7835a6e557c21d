"""DeepSeek V4 checkpoints in every on-disk layout, read under transformers' ``state_dict`` names.

Public interface (what the V4 loaders and savers call):

* ``ckpt = open_v4_checkpoint(path)`` -> :class:`V4Checkpoint`: detects the layout, the
  quantisation and the experts; reads nothing but headers. ``ckpt.keys()`` are the names of
  transformers 5.24's ``DeepseekV4ForCausalLM.state_dict()`` (``model.embed_tokens.weight``,
  ``model.layers.{i}.self_attn.q_a_proj.weight``, ``model.layers.{i}.mlp.experts.gate_up_proj
  [E, 2 * I, H]``, ``model.layers.{i}.mlp.experts.down_proj [E, H, I]``,
  ``model.layers.{i}.mlp.gate.tid2eid``, ``model.hc_head.hc_fn``, ``lm_head.weight``, ...).
  ``ckpt.shape(name)``, ``ckpt.dtype(name)`` and ``ckpt.read(name, index)`` give any slice of
  one tensor (one slice per dim, as ``jax.make_array_from_callback`` asks for a device's part),
  dequantised; only the bytes of that slice are read (for the fused experts: only the experts
  and halves it touches). ``ckpt.disk_keys(name)`` lists the on-disk keys behind a name and
  ``ckpt.unknown`` the keys that are no V4 tensor. The multi-token-prediction (MTP) tensors are
  kept apart from ``keys()`` (transformers has none): ``ckpt.mtp_keys()`` names them
  ``model.mtp.{k}.<the state_dict name of a layer's tensor, after model.layers.{i}.>`` plus
  ``model.mtp.{k}.{e_proj,h_proj,enorm,hnorm,norm}.weight`` and
  ``model.mtp.{k}.hc_head.hc_{fn,base,scale}`` (the state paths of
  :class:`jax_dsa.models.deepseek_v4.mtp.DeepseekV4MTPLayer` under ``model.``), read like any other
  name; ``ckpt.ignored`` lists the ``mtp.*`` keys that are none of these (never presented;
  ``ckpt.read_disk(key, index)`` reads any tensor by its own key). A :class:`V4Checkpoint` has the
  interface of :class:`jax_dsa.interop.reading.CheckpointSource` (``reader``, ``shape``, ``read``,
  ``consumed``), so it is :func:`jax_dsa.interop.reading.fill_state`'s source as it is, with
  ``key_of(path) -> (state_dict_name, False)`` (fused experts are read sliced, not stacked).
* :func:`state_dict_name`: one on-disk key -> its ``state_dict`` name (and which part of a fused
  expert tensor it is).
* :func:`save_pretrained_parts` / :func:`save_pretrained_name`: ``state_dict`` name -> the keys
  (and the slice of the tensor each holds) that transformers' ``save_pretrained`` writes, or the
  DeepSeek release's names (``layout="deepseek"``).

Layouts read (detected from the keys; see docs/models.md, "DeepSeek V4 checkpoints"):

* ``"save_pretrained"``: transformers 5.24's ``save_pretrained`` output. It writes the model's
  weights through the reverse of its ``deepseek_v4`` checkpoint conversion
  (``conversion_mapping.py``), so most keys carry DeepSeek's own names under ``model.``:
  ``model.layers.{i}.attn.wq_a.weight``, ``attn.norm.weight`` (the kv norm),
  ``ffn.experts.{e}.w1.weight``, ``hc_attn_fn``, ... but ``model.embed_tokens.weight``,
  ``model.norm.weight``, ``model.hc_head.hc_fn`` and ``head.weight``.
* ``"deepseek"``: DeepSeek's release (deepseek-ai/DeepSeek-V4-Flash / -Pro): the same names
  without ``model.`` and with ``embed.weight``, ``norm.weight``, ``hc_head_fn``,
  ``attn.kv_norm.weight``; ``mtp.{k}.*`` holds the MTP layers: a layer's names
  (``mtp.{k}.attn.wq_a.weight``, ``mtp.{k}.ffn.experts.{e}.w1.weight``, ``mtp.{k}.hc_attn_fn``,
  ...) plus ``mtp.{k}.{e_proj,h_proj}.weight [hidden, hidden]`` (FP8 with ``.scale`` in the
  release), ``mtp.{k}.{enorm,hnorm,norm}.weight [hidden]`` and ``mtp.{k}.hc_head_fn
  [hc_mult, hc_mult * hidden]`` / ``hc_head_base [hc_mult]`` / ``hc_head_scale [1]`` (DeepSeek
  V4 ``inference/model.py`` ``MTPBlock``). transformers 5.24 builds no MTP and its
  ``save_pretrained`` writes none; :func:`jax_dsa.interop.save_hf` writes them in this naming in
  every layout but ``"state_dict"``.
* ``"state_dict"``: the in-memory names themselves (e.g. ``save_file(model.state_dict())``);
  per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` are accepted too.

Quantisation, recognised per tensor from its dtype (``quantization_config.quant_method`` must be
``"fp8"`` when present):

* Block-scaled FP8 (``F8_E4M3`` / ``F8_E5M2``): the scale is ``{name}.scale`` (DeepSeek's
  release) or ``{name}.weight_scale_inv`` (transformers' FP8 format); F32 or UE8M0
  (``F8_E8M0``, or ``U8`` exponent bytes); over ``quantization_config.weight_block_size`` tiles
  (default 128 x 128; ``w = w_fp8 * scale[i // b0, j // b1]``, edge tiles partial), or over
  1 x 32 tiles (MXFP8) when the scale grid has that shape instead. The release stores its
  attention, shared-expert and indexer ``wq_b`` projections this way (the compressor and indexer
  ``wkv`` / ``wgate`` / ``weights_proj`` in BF16).
* MXFP4 routed experts (the release's ``expert_dtype: "fp4"``): ``I8`` / ``U8`` ``[out, in / 2]``
  (or ``F4`` ``[out, in]``), two E2M1 codes per byte, the even element in the low nibble, times
  a UE8M0 scale ``[out, in / 32]`` per 32 consecutive inputs (OCP Microscaling Formats v1.0;
  DeepSeek V4 ``inference/model.py`` ``Linear`` / ``fp4_gemm``).

Anything else quantised is refused with an error naming the tensor and the format.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jax_dsa.interop.hf_config import read_hf_config
from jax_dsa.interop.reading import (
    DEFAULT_FP8_BLOCK,
    block_scales,
    dequantize_fp8_block,
    scale_values,
)
from jax_dsa.interop.safetensors_io import CheckpointReader
from jax_dsa.models.deepseek_v4.config import MODEL_TYPE

LAYOUTS = ("save_pretrained", "deepseek", "state_dict")
MXFP4_BLOCK = (1, 32)
SUPPORTED_QUANT_METHODS = ("fp8",)

# Top-level tensors: state_dict name -> (save_pretrained key, DeepSeek release key).
_TOP = {
    "model.embed_tokens.weight": ("model.embed_tokens.weight", "embed.weight"),
    "model.norm.weight": ("model.norm.weight", "norm.weight"),
    "model.hc_head.hc_fn": ("model.hc_head.hc_fn", "hc_head_fn"),
    "model.hc_head.hc_base": ("model.hc_head.hc_base", "hc_head_base"),
    "model.hc_head.hc_scale": ("model.hc_head.hc_scale", "hc_head_scale"),
    "lm_head.weight": ("head.weight", "head.weight"),
}

# Per-layer tensors: state_dict name after ``model.layers.{i}.`` -> (save_pretrained name,
# DeepSeek release name) after ``model.layers.{i}.`` / ``layers.{i}.``. The attention entries
# come first, in the order of jax_dsa.models.deepseek_v4.checkpoint.ORIGINAL_NAMES.
LAYER_NAMES = {
    "self_attn.q_a_proj.weight": ("attn.wq_a.weight",) * 2,
    "self_attn.q_a_norm.weight": ("attn.q_norm.weight",) * 2,
    "self_attn.q_b_proj.weight": ("attn.wq_b.weight",) * 2,
    "self_attn.kv_proj.weight": ("attn.wkv.weight",) * 2,
    "self_attn.kv_norm.weight": ("attn.norm.weight", "attn.kv_norm.weight"),
    "self_attn.o_a_proj.weight": ("attn.wo_a.weight",) * 2,
    "self_attn.o_b_proj.weight": ("attn.wo_b.weight",) * 2,
    "self_attn.sinks": ("attn.attn_sink",) * 2,
    "self_attn.compressor.kv_proj.weight": ("attn.compressor.wkv.weight",) * 2,
    "self_attn.compressor.gate_proj.weight": ("attn.compressor.wgate.weight",) * 2,
    "self_attn.compressor.position_bias": ("attn.compressor.ape",) * 2,
    "self_attn.compressor.kv_norm.weight": ("attn.compressor.norm.weight",) * 2,
    "self_attn.compressor.indexer.kv_proj.weight": ("attn.indexer.compressor.wkv.weight",) * 2,
    "self_attn.compressor.indexer.gate_proj.weight":
        ("attn.indexer.compressor.wgate.weight",) * 2,
    "self_attn.compressor.indexer.position_bias": ("attn.indexer.compressor.ape",) * 2,
    "self_attn.compressor.indexer.kv_norm.weight": ("attn.indexer.compressor.norm.weight",) * 2,
    "self_attn.compressor.indexer.q_b_proj.weight": ("attn.indexer.wq_b.weight",) * 2,
    "self_attn.compressor.indexer.scorer.weights_proj.weight":
        ("attn.indexer.weights_proj.weight",) * 2,
    "input_layernorm.weight": ("attn_norm.weight",) * 2,
    "post_attention_layernorm.weight": ("ffn_norm.weight",) * 2,
    "attn_hc.fn": ("hc_attn_fn",) * 2,
    "attn_hc.base": ("hc_attn_base",) * 2,
    "attn_hc.scale": ("hc_attn_scale",) * 2,
    "ffn_hc.fn": ("hc_ffn_fn",) * 2,
    "ffn_hc.base": ("hc_ffn_base",) * 2,
    "ffn_hc.scale": ("hc_ffn_scale",) * 2,
    "mlp.gate.weight": ("ffn.gate.weight",) * 2,
    "mlp.gate.e_score_correction_bias": ("ffn.gate.bias",) * 2,
    "mlp.gate.tid2eid": ("ffn.gate.tid2eid",) * 2,
    "mlp.shared_experts.gate_proj.weight": ("ffn.shared_experts.w1.weight",) * 2,
    "mlp.shared_experts.up_proj.weight": ("ffn.shared_experts.w3.weight",) * 2,
    "mlp.shared_experts.down_proj.weight": ("ffn.shared_experts.w2.weight",) * 2,
}
# Routed experts: transformers fuses them in memory; on disk one tensor per expert and proj.
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
_EXPERT_PROJ = {"w1": (GATE_UP, 0), "w3": (GATE_UP, 1), "w2": (DOWN, None),
                "gate_proj": (GATE_UP, 0), "up_proj": (GATE_UP, 1), "down_proj": (DOWN, None)}

_DISK_TO_LAYER = {}
for _name, _disk in LAYER_NAMES.items():
    for _d in (*_disk, _name):
        _DISK_TO_LAYER[_d] = _name
_DISK_TO_TOP = {d: n for n, disk in _TOP.items() for d in (*disk, n)}
_DISK_TO_TOP.update({  # transformers' in-memory names without the model. prefix
    "embed_tokens.weight": "model.embed_tokens.weight", "hc_head.hc_fn": "model.hc_head.hc_fn",
    "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale",
})
# MTP-only tensors: state_dict name after ``model.mtp.{k}.`` -> the release name after
# ``mtp.{k}.`` (DeepSeek V4 inference/model.py MTPBlock); the rest of an MTP depth is a layer's.
MTP_NAMES = {
    "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_DISK_TO_MTP = {d: n for n, d in MTP_NAMES.items()} | {n: n for n in MTP_NAMES}
_LAYER_KEY = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")
_MTP_NAME = re.compile(r"^(model\.)?mtp\.(\d+)\.(.+)$")
_EXPERT_KEY = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.weight$")
_MTP_KEY = re.compile(r"^(model\.)?mtp\.")
_NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2,
}
_FP8 = ("F8_E4M3", "F8_E5M2")
_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")
_FP4_PACKED = ("I8", "U8")


@dataclass(frozen=True)
class Part:
    """Where an on-disk key lands: ``state_dict`` name, and for a routed expert the expert index
    and (``gate_up_proj`` only) the half: 0 = gate (``w1``), 1 = up (``w3``)."""

    name: str
    expert: int | None = None
    half: int | None = None


def state_dict_name(key: str) -> Part | None:
    """The ``state_dict`` name of an on-disk key in any of :data:`LAYOUTS`; ``None`` for keys that
    are no V4 model tensor (scale tensors included). MTP tensors (``mtp.{k}.*`` or
    ``model.mtp.{k}.*``) get jax_dsa's ``model.mtp.{k}.*`` names (module docstring).

    Example: ``layers.3.attn.kv_norm.weight`` and ``model.layers.3.attn.norm.weight`` ->
    ``Part("model.layers.3.self_attn.kv_norm.weight")``; ``layers.3.ffn.experts.7.w3.weight`` ->
    ``Part("model.layers.3.mlp.experts.gate_up_proj", expert=7, half=1)``;
    ``mtp.0.hc_head_fn`` -> ``Part("model.mtp.0.hc_head.hc_fn")``.
    """
    if key in _DISK_TO_TOP:
        return Part(_DISK_TO_TOP[key])
    m = _LAYER_KEY.match(key)
    mtp = None if m else _MTP_NAME.match(key)
    if mtp:
        prefix, rest = f"model.mtp.{int(mtp.group(2))}.", mtp.group(3)
        if rest in _DISK_TO_MTP:
            return Part(prefix + _DISK_TO_MTP[rest])
    elif not m:
        return None
    else:
        prefix, rest = f"model.layers.{int(m.group(2))}.", m.group(3)
    if rest in _DISK_TO_LAYER:
        return Part(prefix + _DISK_TO_LAYER[rest])
    if rest in (GATE_UP, DOWN):
        return Part(prefix + rest)
    e = _EXPERT_KEY.match(rest)
    if e:
        name, half = _EXPERT_PROJ[e.group(2)]
        return Part(prefix + name, int(e.group(1)), half)
    return None


def _split_layer(name: str) -> tuple[int | None, str]:
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def is_mtp_name(name: str) -> bool:
    """Whether a ``state_dict`` name is an MTP tensor's (``model.mtp.{k}.*``)."""
    return name.startswith("model.mtp.")


def save_pretrained_parts(name: str, shape: Sequence[int], layout: str = "save_pretrained"
                          ) -> list[tuple[str, tuple]]:
    """The on-disk tensors of one ``state_dict`` tensor of ``shape``: ``[(key, index), ...]``,
    each stored as ``tensor[index]`` (``index`` is ``()`` for the whole tensor; for the fused
    experts ``(e, slice(0, I))`` -> ``...experts.{e}.w1.weight`` and so on).

    Args:
      name: a ``state_dict`` name (see :func:`open_v4_checkpoint`).
      shape: its shape (the expert count and ``I`` come from it).
      layout: ``"save_pretrained"`` (what transformers 5.24's ``save_pretrained`` writes, the
        layout :func:`jax_dsa.interop.save_hf` should write), ``"deepseek"`` (the release's
        names) or ``"state_dict"`` (the names unchanged). MTP names (``model.mtp.{k}.*``) get
        the release's ``mtp.{k}.*`` keys in the first two (transformers has no MTP names).

    Raises:
      ValueError: an unknown layout, or a name that is no V4 ``state_dict`` tensor.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"save_pretrained_parts: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "state_dict":
        if state_dict_name(name) != Part(name):
            raise ValueError(f"save_pretrained_parts: {name!r} is no DeepSeek V4 state_dict name")
        return [(name, ())]
    which = LAYOUTS.index(layout)
    if name in _TOP:
        return [(_TOP[name][which], ())]
    layer, rest = _split_layer(name)
    prefix = f"model.layers.{layer}." if layout == "save_pretrained" else f"layers.{layer}."
    mtp = _MTP_NAME.match(name) if name.startswith("model.mtp.") else None
    if mtp:  # the release's naming in both layouts
        layer, rest, which = int(mtp.group(2)), mtp.group(3), 1
        prefix = f"mtp.{layer}."
        if rest in MTP_NAMES:
            return [(prefix + MTP_NAMES[rest], ())]
    if layer is not None and rest in LAYER_NAMES:
        return [(prefix + LAYER_NAMES[rest][which], ())]
    if layer is not None and rest == GATE_UP:
        n_experts, two_i = shape[0], shape[1]
        if len(shape) != 3 or two_i % 2:
            raise ValueError(f"save_pretrained_parts: {name} must be [E, 2 * I, H], got {shape}")
        i = two_i // 2
        return [
            part for e in range(n_experts) for part in (
                (f"{prefix}ffn.experts.{e}.w1.weight", (e, slice(0, i))),
                (f"{prefix}ffn.experts.{e}.w3.weight", (e, slice(i, two_i))),
            )
        ]
    if layer is not None and rest == DOWN:
        return [(f"{prefix}ffn.experts.{e}.w2.weight", (e,)) for e in range(shape[0])]
    raise ValueError(f"save_pretrained_parts: {name!r} is no DeepSeek V4 state_dict name")


def save_pretrained_name(name: str, layout: str = "save_pretrained") -> str:
    """The on-disk key of a ``state_dict`` tensor that is stored whole (everything but the fused
    experts, which :func:`save_pretrained_parts` splits).

    Raises:
      ValueError: a fused expert tensor, or as :func:`save_pretrained_parts`.
    """
    if name.endswith((GATE_UP, DOWN)):
        raise ValueError(
            f"save_pretrained_name: {name} is stored one tensor per expert; use "
            "save_pretrained_parts"
        )
    ((key, _),) = save_pretrained_parts(name, (), layout)
    return key


def _norm_index(index, shape) -> tuple[tuple[int, int, int], ...]:
    if index is None:
        index = (slice(None),) * len(shape)
    if len(index) != len(shape):
        raise ValueError(f"read: index {index} does not match the shape {tuple(shape)}")
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))


class V4Checkpoint:
    """A DeepSeek V4 checkpoint directory seen under ``state_dict`` names (module docstring).

    Build it with :func:`open_v4_checkpoint`. Attributes: ``path``, ``config`` (the
    ``config.json`` dict), ``layout`` (one of :data:`LAYOUTS`), ``block`` (the FP8 tile),
    ``quantized`` (``{"fp8": n, "mxfp4": n}`` on-disk tensor counts, MTP included),
    ``mtp_depths`` (the MTP depths ``k`` with tensors on disk, sorted), ``ignored`` (``mtp.*``
    keys that are no MTP tensor jax_dsa knows), ``unknown`` (other keys that are no V4 tensor),
    ``reader`` (itself, for :func:`~jax_dsa.interop.reading.fill_state`).
    """

    def __init__(self, path: str | os.PathLike, config: dict | None = None):
        self.path = os.fspath(path)
        self.config = read_hf_config(path) if config is None else dict(config)
        if self.config.get("model_type") != MODEL_TYPE:
            raise ValueError(
                f"open_v4_checkpoint: model_type must be {MODEL_TYPE!r}, got "
                f"{self.config.get('model_type')!r}"
            )
        quant = self.config.get("quantization_config") or {}
        if quant and quant.get("quant_method") not in SUPPORTED_QUANT_METHODS:
            raise ValueError(
                f"open_v4_checkpoint: quantization_config.quant_method "
                f"{quant.get('quant_method')!r} is not supported (supported: "
                f"{SUPPORTED_QUANT_METHODS}: block-scaled FP8, MXFP4 routed experts)"
            )
        self.block = tuple(quant.get("weight_block_size") or DEFAULT_FP8_BLOCK)
        self._reader = CheckpointReader(path)
        self.reader = self
        try:
            self._index()
        except Exception:
            self._reader.close()
            raise

    # -- building the name table -----------------------------------------------------------

    def _index(self):
        r = self._reader
        keys = r.keys()
        scales = {}
        for k in keys:
            for suffix, base in ((".scale", ".weight"), ("_scale_inv", "")):
                if k.endswith(suffix) and k[: -len(suffix)] + base in r:
                    weight = k[: -len(suffix)] + base
                    if weight in scales:
                        raise ValueError(
                            f"open_v4_checkpoint: {weight} has two scales, {scales[weight]} and {k}"
                        )
                    scales[weight] = k
        self._scale = scales
        scale_keys = set(scales.values())
        self.ignored, self.unknown = [], []
        self._whole: dict[str, str] = {}
        self._parts: dict[str, dict[tuple, str]] = {}
        self._format: dict[str, str] = {}
        self.quantized = {"fp8": 0, "mxfp4": 0}
        prefixed = unprefixed = False
        saved = False
        self._block: dict[str, tuple[int, int]] = {}
        for k in keys:
            if k in scale_keys:
                continue
            part = state_dict_name(k)
            if part is None:
                if _MTP_KEY.match(k):
                    self.ignored.append(k)
                    self._format[k] = self._classify(k, Part(k))
                else:
                    self.unknown.append(k)
                continue
            if k.startswith("layers."):
                unprefixed = True
            elif k.startswith("model.layers."):
                prefixed = True
                rest = _LAYER_KEY.match(k).group(3)
                # DeepSeek's spelling under model.: what save_pretrained writes.
                saved |= rest not in LAYER_NAMES and not rest.startswith("mlp.")
            self._format[k] = self._classify(k, part)
            if part.expert is None:
                if part.name in self._whole or part.name in self._parts:
                    raise ValueError(
                        f"open_v4_checkpoint: {part.name} is stored twice (e.g. {k} and "
                        f"{self._whole.get(part.name)})"
                    )
                self._whole[part.name] = k
            else:
                parts = self._parts.setdefault(part.name, {})
                slot = (part.expert, part.half)
                if slot in parts or part.name in self._whole:
                    raise ValueError(
                        f"open_v4_checkpoint: expert {part.expert} of {part.name} is stored twice "
                        f"({k} and {parts.get(slot, self._whole.get(part.name))})"
                    )
                parts[slot] = k
        if prefixed and unprefixed:
            raise ValueError(
                f"open_v4_checkpoint: {self.path} mixes model.layers.* and layers.* keys (two "
                "layouts in one directory?)"
            )
        self.layout = "deepseek" if unprefixed else ("save_pretrained" if saved else "state_dict")
        self._shapes: dict[str, tuple[int, ...]] = {}
        for name, parts in self._parts.items():
            self._shapes[name] = self._fused_shape(name, parts)
        for name, k in self._whole.items():
            self._shapes[name] = self._disk_shape(k)
        self.mtp_depths = sorted({int(_MTP_NAME.match(n).group(2)) for n in self._shapes
                                  if is_mtp_name(n)})

    def _classify(self, key: str, part: Part) -> str:
        """``"plain"``, ``"fp8"`` or ``"mxfp4"`` (recording the scale tile in ``_block``); refuses
        other quantised tensors and scale grids that fit no tile."""
        r = self._reader
        dtype, shape = r.dtype(key), r.shape(key)
        scale = self._scale.get(key)
        if dtype in _FP8:
            if scale is not None and len(shape) != 2:
                raise ValueError(
                    f"open_v4_checkpoint: {key} is a {len(shape)}-D FP8 tensor ({dtype}, shape "
                    f"{shape}, scale {scale}); block-scaled FP8 is read as 2-D weights only "
                    "(store fused experts one tensor per expert, ffn.experts.E.w1/w2/w3)"
                )
            if scale is None:
                raise ValueError(
                    f"open_v4_checkpoint: {key} is FP8 ({dtype}, shape {shape}) without the 2-D "
                    f"block scale {key.removesuffix('.weight')}.scale or {key}_scale_inv"
                )
            # The configured tile (DeepSeek's 128 x 128), else MX tiles of 1 x 32 (MXFP8).
            self._block[key] = self._tile(key, scale, shape, (self.block, MXFP4_BLOCK), "FP8")
            self.quantized["fp8"] += 1
            return "fp8"
        if scale is not None and dtype in (*_FP4_PACKED, "F4") and len(shape) == 2:
            logical = shape if dtype == "F4" else (shape[0], 2 * shape[1])
            self._block[key] = self._tile(key, scale, logical, (MXFP4_BLOCK,), "MXFP4")
            self.quantized["mxfp4"] += 1
            return "mxfp4"
        if scale is not None:
            raise ValueError(
                f"open_v4_checkpoint: {key} is {dtype} {shape} with a scale {scale}: not a format "
                "jax_dsa reads (block-scaled FP8 E4M3/E5M2, or MXFP4 as I8/U8 [out, in / 2] or "
                "F4 [out, in] with UE8M0 scales per 32 inputs)"
            )
        if dtype not in _NP_DTYPES:
            raise ValueError(
                f"open_v4_checkpoint: {key} has dtype {dtype} without a scale; jax_dsa reads "
                f"{sorted(_NP_DTYPES)} unscaled"
            )
        if dtype in ("I8", "U8") and part.name.endswith("weight"):
            raise ValueError(
                f"open_v4_checkpoint: {key} is {dtype} without a scale: a quantised weight "
                "(e.g. MXFP4 without its .scale) that jax_dsa cannot read"
            )
        return "plain"

    def _tile(self, key, scale, shape, tiles, fmt) -> tuple[int, int]:
        """The first of ``tiles`` whose grid ``[ceil(rows / b0), ceil(cols / b1)]`` is the scale's
        shape."""
        r = self._reader
        if r.dtype(scale) not in _SCALE_DTYPES:
            raise ValueError(
                f"open_v4_checkpoint: the {fmt} scale {scale} is {r.dtype(scale)}; scales must be "
                f"one of {_SCALE_DTYPES}"
            )
        grids = [(-(-shape[0] // b0), -(-shape[1] // b1)) for b0, b1 in tiles]
        for tile, grid in zip(tiles, grids, strict=True):
            if tuple(r.shape(scale)) == grid:
                return tuple(tile)
        raise ValueError(
            f"open_v4_checkpoint: the {fmt} scale {scale} has shape {tuple(r.shape(scale))}; for "
            f"{key} of (logical) shape {tuple(shape)} it must be one of {grids} (tiles {tiles})"
        )

    def _disk_shape(self, key: str) -> tuple[int, ...]:
        """The logical shape (an MXFP4 ``I8`` / ``U8`` tensor holds two values per byte)."""
        shape = self._reader.shape(key)
        if self._format[key] == "mxfp4" and self._reader.dtype(key) != "F4":
            return (shape[0], 2 * shape[1])
        return tuple(shape)

    def _fused_shape(self, name: str, parts: dict) -> tuple[int, ...]:
        experts = sorted({e for e, _ in parts})
        n = len(experts)
        want = self.config.get("n_routed_experts")
        if experts != list(range(n)) or (want is not None and n != want):
            raise ValueError(
                f"open_v4_checkpoint: {name} has experts {experts[:3]}...{experts[-3:]} on disk "
                f"({n}), expected 0..{(want or n) - 1}"
            )
        halves = (0, 1) if name.endswith(GATE_UP) else (None,)
        missing = [(e, h) for e in experts for h in halves if (e, h) not in parts]
        if missing:
            raise ValueError(f"open_v4_checkpoint: {name} lacks experts/halves {missing[:5]}")
        shapes = {self._disk_shape(k) for k in parts.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(
                f"open_v4_checkpoint: the experts of {name} have shapes {sorted(shapes)}, "
                "expected one 2-D shape"
            )
        rows, cols = shapes.pop()
        return (n, rows * len(halves), cols)

    # -- the CheckpointSource interface -----------------------------------------------------

    def keys(self) -> list[str]:
        """The ``state_dict`` names present (MTP names, ``ignored`` and ``unknown`` keys
        excluded)."""
        return [n for n in self._shapes if not is_mtp_name(n)]

    def mtp_keys(self) -> list[str]:
        """The MTP tensors' names present (``model.mtp.{k}.*``, module docstring); :meth:`read`,
        :meth:`shape`, :meth:`dtype` and :meth:`disk_keys` take them as they take :meth:`keys`."""
        return [n for n in self._shapes if is_mtp_name(n)]

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        """The ``state_dict`` shape (logical, dequantised)."""
        return self._shapes[name]

    def dtype(self, name: str) -> np.dtype:
        """The NumPy dtype :meth:`read` returns: float32 for quantised tensors, else the stored
        one (``ml_dtypes.bfloat16`` for ``BF16``)."""
        keys = self._disk_keys(name)
        if any(self._format[k] != "plain" for k in keys):
            return np.dtype(np.float32)
        return np.dtype(_NP_DTYPES[self._reader.dtype(keys[0])])

    def _disk_keys(self, name: str) -> list[str]:
        if name in self._whole:
            return [self._whole[name]]
        return list(self._parts[name].values())

    def consumed(self, name: str) -> list[str]:
        """``[name]``: what :func:`~jax_dsa.interop.reading.fill_state` records as read, in the
        name space of :meth:`keys` (so ``set(ckpt.keys()) - consumed`` is what a model left)."""
        return [name]

    def disk_keys(self, name: str) -> list[str]:
        """The on-disk keys behind ``name``: its tensors (one per expert and half for the fused
        experts) and their scales."""
        keys = self._disk_keys(name)
        return keys + [self._scale[k] for k in keys if k in self._scale]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """``tensor[index]`` of the ``state_dict`` tensor ``name`` (``index``: one slice per dim,
        ``None`` for all), dequantised to float32 where stored quantised.

        Raises:
          KeyError: ``name`` is not in :meth:`keys`.
          ValueError: a scale grid of the wrong shape or dtype.
        """
        shape = self.shape(name)
        ranges = _norm_index(index, shape)
        if name in self._whole:
            return self._read_disk(self._whole[name], ranges)
        (e0, e1, es), (r0, r1, rs), cols = ranges
        parts = self._parts[name]
        out = []
        for e in range(e0, e1, es):
            if name.endswith(GATE_UP):
                half = shape[1] // 2
                pieces = []
                for h in (0, 1):
                    lo, hi = max(r0, h * half) - h * half, min(r1, (h + 1) * half) - h * half
                    if lo < hi:
                        pieces.append(self._read_disk(parts[(e, h)], ((lo, hi, 1), cols)))
                rows = np.concatenate(pieces) if pieces else np.zeros(
                    (0, len(range(*cols))), self.dtype(name))
            else:
                rows = self._read_disk(parts[(e, None)], ((r0, r1, 1), cols))
            out.append(rows[::rs])
        if not out:
            return np.zeros((0, len(range(r0, r1, rs)), len(range(*cols))), self.dtype(name))
        return np.stack(out)

    def _read_disk(self, key: str, ranges) -> np.ndarray:
        """``key[ranges]`` (``(start, stop, step)`` per dim, logical), dequantised."""
        contiguous = tuple(slice(a, b) for a, b, _ in ranges)
        steps = tuple(slice(None, None, s) for _, _, s in ranges)
        fmt = self._format[key]
        if fmt == "plain":
            return self._reader.read(key, contiguous)[steps]
        if fmt == "fp8":
            w = dequantize_fp8_block(self._reader, key, self._scale[key], contiguous,
                                     self._block[key])
            return w[steps]
        return self._read_mxfp4(key, contiguous)[steps]

    def _read_mxfp4(self, key: str, index: tuple[slice, slice]) -> np.ndarray:
        r = self._reader
        rows, cols = self._disk_shape(key)
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(index, (rows, cols), strict=True))
        if cols % 2:
            raise ValueError(f"load_hf: MXFP4 tensor {key} has an odd input width {cols}")
        b0, b1 = c0 // 2, -(-c1 // 2)
        if r.dtype(key) == "F4":
            packed = r.raw_bytes(key).reshape(rows, cols // 2)[r0:r1, b0:b1]
        else:
            packed = r.read(key, (slice(r0, r1), slice(b0, b1))).view(np.uint8)
        codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(r1 - r0, 2 * (b1 - b0))
        values = codes.view(jnp.float4_e2m1fn).astype(np.float32)[:, c0 - 2 * b0:c1 - 2 * b0]
        scale_key = self._scale[key]
        scale_dtype = r.dtype(scale_key)

        def read_scale(srows, scols):
            return scale_values(r.read(scale_key, (srows, scols)), scale_dtype, scale_key)

        scale = block_scales(read_scale, r.shape(scale_key), (rows, cols), index, MXFP4_BLOCK, key)
        return values * scale

    def read_disk(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """An on-disk tensor by its own key (e.g. one of ``ignored``), dequantised
        like :meth:`read`; ``index`` is in its logical shape.

        Raises:
          KeyError: ``key`` is a scale, an ``unknown`` key or absent.
        """
        if key not in self._format:
            raise KeyError(f"read_disk: {key!r} is no tensor this checkpoint presents")
        return self._read_disk(key, _norm_index(index, self._disk_shape(key)))

    def close(self):
        self._reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_v4_checkpoint(path: str | os.PathLike, config: dict | None = None) -> V4Checkpoint:
    """Open a DeepSeek V4 checkpoint directory in any layout (module docstring).

    Args:
      path: the directory (``config.json`` and safetensors files).
      config: the ``config.json`` dict, if already read.

    Returns:
      A :class:`V4Checkpoint` (a context manager; close it, or use ``with``).

    Raises:
      FileNotFoundError: no ``config.json`` or no safetensors file.
      ValueError: not ``model_type: "deepseek_v4"``, an unsupported ``quant_method``, a tensor in
        a quantised format jax_dsa does not read (named, with its dtype), an FP8 tensor without
        its scale, a tensor stored twice, an incomplete set of routed experts, or two layouts'
        keys mixed in one directory.
    """
    return V4Checkpoint(path, config)


__all__ = [
    "DOWN", "GATE_UP", "LAYER_NAMES", "LAYOUTS", "MTP_NAMES", "MXFP4_BLOCK", "Part",
    "V4Checkpoint", "is_mtp_name", "open_v4_checkpoint", "save_pretrained_name",
    "save_pretrained_parts", "state_dict_name",
]
