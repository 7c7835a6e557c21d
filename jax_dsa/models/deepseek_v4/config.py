"""DeepSeek V4 configurations (V4-Flash, V4-Pro and a tiny V4 for tests and examples).

Field names follow transformers' ``DeepseekV4Config`` (``model_type="deepseek_v4"``,
``src/transformers/models/deepseek_v4/configuration_deepseek_v4.py``, transformers 5.24) and the
checkpoints' ``config.json`` (``compress_ratios``, ``compress_rope_theta``, ``rope_scaling``), so
that :meth:`DeepseekV4Config.from_hf_dict` maps either onto this class. Dimensions: DeepSeek V4
Flash / Pro ``config.json`` (deepseek-ai, mirrored as yafengge/DeepSeek-V4-Flash).

Attention, per layer type (``layer_types[i]``):

* ``"sliding_attention"`` (``compress_ratio`` 0): a window of ``sliding_window`` raw KV rows.
* ``"compressed_sparse_attention"`` (CSA, ratio ``compress_rate_csa`` = 4): the window plus the
  indexer's top ``index_topk`` compressed entries (overlapping windows of 2m, stride m).
* ``"heavily_compressed_attention"`` (HCA, ratio ``compress_rate_hca`` = 128): the window plus
  every visible compressed entry (non-overlapping windows of m).

RoPE: window-only layers use plain RoPE with ``rope_theta`` (10000); compressed layers use
``compress_rope_parameters`` (YaRN, ``compress_rope_theta`` 160000, factor 16, original 65536, and
``attention_factor`` 1: no YaRN scale on cos/sin, as in transformers).

Feed-forward, per layer (``mlp_layer_types[i]``): ``"moe"`` (top-k router with
``scoring_func``) or ``"hash_moe"`` (experts chosen by a frozen token-id table), both with one
shared expert of width ``moe_intermediate_size`` and SwiGLU pre-activations clipped at
``swiglu_limit``. Residuals: ``hc_mult`` hyper-connection streams (mHC, Sinkhorn-normalised
mixes). The multi-token-prediction layers (``num_nextn_predict_layers``) are built only on request
(``DeepseekV4LanguageModel(..., mtp=True)``): transformers does not build them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax_dsa.nn.rope_parameters import RopeParameters

MODEL_TYPE = "deepseek_v4"  # config.json's model_type
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")  # what transformers 5.24 builds (no "softmax")
DEFAULT_NUM_HASH_LAYERS = 3  # transformers' ``default_num_hash_layers``

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


def default_layer_types(num_hidden_layers: int) -> tuple[str, ...]:
    """transformers' default schedule (V4-Pro): two HCA layers, then HCA / CSA alternating
    (``DeepseekV4Config.__post_init__``)."""
    n = num_hidden_layers
    rest = tuple(CSA if i % 2 else HCA for i in range(max(n - 2, 0)))
    return ((HCA,) * min(n, 2) + rest)[:n]


def default_mlp_layer_types(
    num_hidden_layers: int, num_hash_layers: int = DEFAULT_NUM_HASH_LAYERS
) -> tuple[str, ...]:
    """transformers' default MoE schedule: ``num_hash_layers`` ``"hash_moe"`` layers, then
    ``"moe"`` (``DeepseekV4Config.__post_init__``)."""
    n, k = num_hidden_layers, max(int(num_hash_layers), 0)
    return ("hash_moe",) * min(n, k) + ("moe",) * max(n - k, 0)


def layer_types_from_ratios(
    compress_ratios, num_hidden_layers: int, compress_rate_csa: int = 4,
    compress_rate_hca: int = 128,
) -> tuple[str, ...]:
    """Layer types from a checkpoint's ``compress_ratios`` (0 / CSA rate / HCA rate per layer).

    Entries past ``num_hidden_layers`` (the MTP layer, padding) are dropped, as transformers does.

    Raises:
      ValueError: fewer entries than layers, or a ratio that is none of 0 and the two rates.
    """
    table = {0: SLIDING, int(compress_rate_csa): CSA, int(compress_rate_hca): HCA}
    ratios = [int(r) for r in compress_ratios][:num_hidden_layers]
    if len(ratios) < num_hidden_layers:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries for num_hidden_layers={num_hidden_layers}"
        )
    bad = sorted({r for r in ratios if r not in table})
    if bad:
        raise ValueError(
            f"compress_ratios entries must be 0, compress_rate_csa={compress_rate_csa} or "
            f"compress_rate_hca={compress_rate_hca}; got {bad}"
        )
    return tuple(table[r] for r in ratios)


def _v4_compress_rope(theta=160000.0, factor=16.0, original=65536) -> RopeParameters:
    return RopeParameters(
        rope_type="yarn", rope_theta=theta, factor=factor,
        original_max_position_embeddings=original,
        beta_fast=32.0, beta_slow=1.0, attention_factor=1.0,
    )


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """A DeepSeek V4 decoder configuration in Hugging Face field names (hashable, frozen).

    Attention dimensions: ``num_attention_heads`` query heads of ``head_dim`` (512) and one
    shared K = V row of ``head_dim`` per token (``num_key_value_heads`` must be 1); RoPE on the
    last ``qk_rope_head_dim`` (64) dims, interleaved pairs; q path ``hidden -> q_lora_rank ->
    heads x head_dim``; grouped output projection ``o_groups`` x ``o_lora_rank``; per-head sink;
    ``sliding_window`` raw rows per query. CSA indexer: ``index_n_heads`` x ``index_head_dim``,
    top ``index_topk`` compressed entries.

    ``layer_types`` defaults to transformers' schedule (:func:`default_layer_types`); checkpoints
    give ``compress_ratios`` instead (:meth:`from_hf_dict`). ``mlp_layer_types`` defaults to
    three ``"hash_moe"`` layers then ``"moe"`` (:func:`default_mlp_layer_types`); checkpoints
    may give ``num_hash_layers`` instead. ``intermediate_size`` is, as in transformers, another
    name of ``moe_intermediate_size`` (the width of every expert and of the shared expert).

    MoE: ``n_routed_experts`` experts, ``num_experts_per_tok`` per token, gate values
    ``scoring_func(router logits)`` of the chosen experts, normalised to sum 1 (transformers
    always normalises: ``norm_topk_prob`` is recorded only) and scaled by
    ``routed_scaling_factor``; ``n_shared_experts`` must be 1. mHC: ``hc_mult`` streams,
    ``hc_sinkhorn_iters`` Sinkhorn-Knopp iterations with floor ``hc_eps``.

    Raises:
      ValueError: inconsistent dimensions or unknown layer types.
    """

    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_parameters: RopeParameters = _v4_compress_rope()
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    attention_bias: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # MoE and mHC; MTP (num_nextn_predict_layers) is built only with mtp=True.
    mlp_layer_types: tuple[str, ...] | None = None
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 1

    def __post_init__(self):
        types = (
            default_layer_types(self.num_hidden_layers)
            if self.layer_types is None else tuple(self.layer_types)
        )
        object.__setattr__(self, "layer_types", types)
        mlp_types = (
            default_mlp_layer_types(self.num_hidden_layers)
            if self.mlp_layer_types is None else tuple(self.mlp_layer_types)
        )
        object.__setattr__(self, "mlp_layer_types", mlp_types)
        positive = (
            "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "head_dim", "q_lora_rank", "qk_rope_head_dim", "o_groups",
            "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
            "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DeepseekV4Config: {name} must be a positive int, got {value!r}")
        if self.num_key_value_heads != 1:
            raise ValueError(
                "DeepseekV4Config: num_key_value_heads must be 1 (one shared K = V row), got "
                f"{self.num_key_value_heads}"
            )
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(
            self.head_dim, self.index_head_dim
        ):
            raise ValueError(
                f"DeepseekV4Config: qk_rope_head_dim={self.qk_rope_head_dim} must be even and at "
                f"most head_dim={self.head_dim} and index_head_dim={self.index_head_dim}"
            )
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"DeepseekV4Config: num_attention_heads * head_dim = "
                f"{self.num_attention_heads * self.head_dim} must be divisible by o_groups="
                f"{self.o_groups}"
            )
        for name in ("compress_rate_csa", "compress_rate_hca"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"DeepseekV4Config: {name} must be an int >= 2, got {value!r}")
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"DeepseekV4Config: layer_types has {len(types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(
                f"DeepseekV4Config: layer_types entries must be in {LAYER_TYPES}, got {bad}"
            )
        if not isinstance(self.compress_rope_parameters, RopeParameters):
            raise TypeError("DeepseekV4Config: compress_rope_parameters must be a RopeParameters")
        if self.hidden_act != "silu":
            raise ValueError(
                f"DeepseekV4Config: only hidden_act='silu' is built, got {self.hidden_act!r}"
            )
        if len(mlp_types) != self.num_hidden_layers:
            raise ValueError(
                f"DeepseekV4Config: mlp_layer_types has {len(mlp_types)} entries, "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted({t for t in mlp_types if t not in MLP_LAYER_TYPES})
        if bad:
            raise ValueError(
                f"DeepseekV4Config: mlp_layer_types entries must be in {MLP_LAYER_TYPES}, got {bad}"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"DeepseekV4Config: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"n_routed_experts={self.n_routed_experts}"
            )
        if self.n_shared_experts != 1:
            raise ValueError(
                "DeepseekV4Config: n_shared_experts must be 1 (transformers builds one shared "
                f"expert of width moe_intermediate_size), got {self.n_shared_experts}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"DeepseekV4Config: scoring_func must be one of {SCORING_FUNCS} (transformers "
                f"5.24's DeepseekV4 router has no other), got {self.scoring_func!r}"
            )
        if not self.swiglu_limit > 0:
            raise ValueError(
                f"DeepseekV4Config: swiglu_limit must be > 0, got {self.swiglu_limit!r}"
            )
        if not self.hc_eps >= 0:
            raise ValueError(f"DeepseekV4Config: hc_eps must be >= 0, got {self.hc_eps!r}")
        if isinstance(self.num_nextn_predict_layers, bool) or self.num_nextn_predict_layers < 0:
            raise ValueError(
                "DeepseekV4Config: num_nextn_predict_layers must be an int >= 0, got "
                f"{self.num_nextn_predict_layers!r}"
            )

    # Derived quantities ------------------------------------------------------------------------

    @property
    def intermediate_size(self) -> int:
        """transformers' alias of ``moe_intermediate_size`` (``attribute_map``)."""
        return self.moe_intermediate_size

    @property
    def num_hash_layers(self) -> int:
        """How many layers route by the token-id table (``"hash_moe"``)."""
        return self.mlp_layer_types.count("hash_moe")

    def is_hash_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "hash_moe"

    @property
    def rope_parameters(self) -> RopeParameters:
        """The ``"main"`` RoPE of window-only layers: plain, base ``rope_theta``."""
        return RopeParameters(rope_type="default", rope_theta=float(self.rope_theta))

    @property
    def compress_rope_theta(self) -> float:
        return self.compress_rope_parameters.rope_theta

    @property
    def compress_rates(self) -> dict[str, int]:
        return {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Per-layer compression ratio as in the checkpoints (0 = window only)."""
        return tuple(self.compress_ratio(i) for i in range(self.num_hidden_layers))

    def compress_ratio(self, layer_idx: int) -> int:
        t = self.layer_types[layer_idx]
        return 0 if t == SLIDING else self.compress_rates[t]

    def rope_parameters_for(self, layer_type: str) -> RopeParameters:
        """``"main"`` RoPE for window-only layers, ``compress_rope_parameters`` otherwise (the
        layer's q, kv and compressed entries, and the CSA indexer, all use it)."""
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"rope_parameters_for: layer_type must be in {LAYER_TYPES}")
        return self.rope_parameters if layer_type == SLIDING else self.compress_rope_parameters

    @property
    def softmax_scale(self) -> float:
        """Attention ``sm_scale``: ``head_dim ** -0.5`` (512**-0.5 for V4)."""
        return self.head_dim**-0.5

    @property
    def d_qk(self) -> int:
        return self.head_dim

    @property
    def d_v(self) -> int:
        return self.head_dim

    @property
    def indexer_weight_scale(self) -> float:
        """Constant on the CSA indexer's head weights: ``index_n_heads ** -0.5 *
        index_head_dim ** -0.5`` (transformers ``DeepseekV4IndexerScorer``)."""
        return self.index_n_heads**-0.5 * self.index_head_dim**-0.5

    @property
    def partial_rotary_factor(self) -> float:
        return self.qk_rope_head_dim / self.head_dim

    # Conversion --------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> DeepseekV4Config:
        """Build from a transformers ``DeepseekV4Config.to_dict()`` or a checkpoint
        ``config.json`` (unknown keys are ignored).

        Accepts ``layer_types`` or ``compress_ratios``; ``compress_rates`` (dict) or
        ``compress_rate_csa`` / ``compress_rate_hca``; ``partial_rotary_factor`` or
        ``qk_rope_head_dim``; nested ``rope_parameters`` (``{"main": ..., "compress": ...}``) or
        a flat ``rope_scaling`` / ``rope_parameters`` with ``rope_theta`` and
        ``compress_rope_theta`` (the YaRN part applies to compressed layers only, with
        ``attention_factor`` 1 unless given).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        kw.pop("compress_rope_parameters", None)
        rates = d.get("compress_rates") or {}
        csa = int(rates.get(CSA, d.get("compress_rate_csa") or 4))
        hca = int(rates.get(HCA, d.get("compress_rate_hca") or 128))
        kw["compress_rate_csa"], kw["compress_rate_hca"] = csa, hca
        head_dim = int(d.get("head_dim") or 512)
        if d.get("qk_rope_head_dim") is None and d.get("partial_rotary_factor") is not None:
            kw["qk_rope_head_dim"] = int(head_dim * d["partial_rotary_factor"])
        n = int(d.get("num_hidden_layers") or 43)
        if d.get("mlp_layer_types") is not None:
            kw["mlp_layer_types"] = tuple(d["mlp_layer_types"])[:n]
        else:
            hash_layers = d.get("num_hash_layers")
            kw["mlp_layer_types"] = default_mlp_layer_types(
                n, DEFAULT_NUM_HASH_LAYERS if hash_layers is None else int(hash_layers))
        if d.get("layer_types") is not None:
            kw["layer_types"] = tuple(d["layer_types"])[:n]
        elif d.get("compress_ratios") is not None:
            kw["layer_types"] = layer_types_from_ratios(d["compress_ratios"], n, csa, hca)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if isinstance(rope.get("main"), Mapping) and isinstance(rope.get("compress"), Mapping):
            main, comp = rope["main"], dict(rope["compress"])
            kw["rope_theta"] = float(main.get("rope_theta", d.get("rope_theta") or 10000.0))
        else:
            comp = {k: v for k, v in rope.items() if k not in ("main", "compress", "rope_theta")}
            comp["rope_theta"] = float(d.get("compress_rope_theta") or 160000.0)
            if "rope_theta" in rope and d.get("rope_theta") is None:
                kw["rope_theta"] = float(rope["rope_theta"])
        if comp.get("rope_type", comp.get("type", "default")) == "yarn":
            comp.setdefault("attention_factor", 1.0)
        comp.pop("partial_rotary_factor", None)
        kw["compress_rope_parameters"] = RopeParameters.from_hf_dict(comp)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The fields transformers' ``DeepseekV4Config(**d)`` accepts (``compress_ratios`` is
        folded into ``layer_types``, ``num_hash_layers`` into ``mlp_layer_types``)."""
        rp = self.compress_rope_parameters
        compress = {"rope_type": rp.rope_type, "rope_theta": rp.rope_theta}
        if rp.rope_type == "yarn":
            compress.update(
                factor=rp.factor,
                original_max_position_embeddings=rp.original_max_position_embeddings,
                beta_fast=rp.beta_fast, beta_slow=rp.beta_slow,
                attention_factor=rp.cos_sin_scale,
            )
        prf = self.partial_rotary_factor
        compress["partial_rotary_factor"] = prf
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name not in ("compress_rope_parameters", "layer_types", "mlp_layer_types",
                              "compress_rate_csa", "compress_rate_hca", "qk_rope_head_dim",
                              "model_type", "hidden_act")
        }
        out.update(
            layer_types=list(self.layer_types),
            mlp_layer_types=list(self.mlp_layer_types),
            compress_rates=dict(self.compress_rates),
            partial_rotary_factor=prf,
            compress_rope_theta=rp.rope_theta,
            rope_parameters={
                "main": {"rope_type": "default", "rope_theta": float(self.rope_theta),
                         "partial_rotary_factor": prf},
                "compress": compress,
            },
        )
        return out


# Presets ---------------------------------------------------------------------------------------

# V4-Flash config.json: compress_ratios [0, 0] + [4, 128] * 20 + [4] (+ 0 for the MTP layer).
_FLASH = DeepseekV4Config(
    vocab_size=129280,
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    q_lora_rank=1024,
    qk_rope_head_dim=64,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    layer_types=layer_types_from_ratios([0, 0] + [4, 128] * 20 + [4], 43),
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    rope_theta=10000.0,
    compress_rope_parameters=_v4_compress_rope(),
    rms_norm_eps=1e-6,
    max_position_embeddings=1048576,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    num_experts_per_tok=6,
    routed_scaling_factor=1.5,
)

# V4-Pro config.json: compress_ratios [128, 128] + [4, 128] * 29 + [4] (+ 0 for the MTP layer).
_PRO = dataclasses.replace(
    _FLASH,
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    layer_types=layer_types_from_ratios([128, 128] + [4, 128] * 29 + [4], 61),
    index_topk=1024,
    moe_intermediate_size=3072,
    mlp_layer_types=None,
    n_routed_experts=384,
    routed_scaling_factor=2.5,
)

# Tiny, byte-level: every layer type once (CSA twice), windows and rates small enough that a
# 256-token row exercises the window, the compression and the top-k; one hash-routed MoE layer,
# two hyper-connection streams.
_TINY = dataclasses.replace(
    _FLASH,
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    q_lora_rank=64,
    qk_rope_head_dim=16,
    o_groups=2,
    o_lora_rank=32,
    sliding_window=32,
    layer_types=(SLIDING, CSA, HCA, CSA),
    compress_rate_csa=4,
    compress_rate_hca=16,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=16,
    compress_rope_parameters=_v4_compress_rope(theta=160000.0, factor=4.0, original=1024),
    max_position_embeddings=4096,
    mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    hc_mult=2,
    num_nextn_predict_layers=0,
)

PRESETS: dict[str, DeepseekV4Config] = {
    "deepseek-v4-flash": _FLASH,
    "deepseek-v4-pro": _PRO,
    "deepseek-v4-tiny": _TINY,
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def get_v4_config(name: str, **overrides: Any) -> DeepseekV4Config:
    """The V4 preset ``name`` (one of :data:`PRESET_NAMES`) with optional field overrides.

    Overriding ``num_hidden_layers`` without ``layer_types`` (``mlp_layer_types``) keeps the
    preset's schedule cut or extended by transformers' default alternation (by ``"moe"``).

    Raises:
      KeyError: an unknown preset name (the message lists the known ones).
    """
    try:
        config = PRESETS[name]
    except KeyError:
        raise KeyError(f"get_v4_config: unknown preset {name!r}; known: {PRESET_NAMES}") from None
    if overrides:
        n = overrides.get("num_hidden_layers")
        if n is not None and "layer_types" not in overrides:
            types = config.layer_types[:n]
            overrides["layer_types"] = types + default_layer_types(n)[len(types):]
        if n is not None and "mlp_layer_types" not in overrides:
            types = config.mlp_layer_types[:n]
            overrides["mlp_layer_types"] = types + ("moe",) * (n - len(types))
        config = dataclasses.replace(config, **overrides)
    return config


__all__ = [
    "CSA",
    "HCA",
    "LAYER_TYPES",
    "MLP_LAYER_TYPES",
    "SCORING_FUNCS",
    "PRESETS",
    "PRESET_NAMES",
    "SLIDING",
    "DeepseekV4Config",
    "default_layer_types",
    "default_mlp_layer_types",
    "get_v4_config",
    "layer_types_from_ratios",
]
