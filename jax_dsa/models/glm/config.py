"""GLM-5 / GLM-5.2 / DeepSeek V3.2 configurations (:class:`DSAConfig`) and tiny test versions.

Field names follow the Hugging Face configs ``GlmMoeDsaConfig`` (``model_type="glm_moe_dsa"``)
and ``DeepseekV32Config`` (``model_type="deepseek_v32"``) in huggingface/transformers
(``src/transformers/models/glm_moe_dsa/``, ``src/transformers/models/deepseek_v32/``), so that a
``config.json`` maps onto :class:`DSAConfig` field by field (:meth:`DSAConfig.from_hf_dict`).
The real dimensions are those of the released checkpoints' ``config.json`` on the Hugging Face
Hub (zai-org/GLM-5, zai-org/GLM-5.2, deepseek-ai/DeepSeek-V3.2-Exp).

The language model in :mod:`jax_dsa.nn` uses the MoE block of :mod:`jax_dsa.models.glm.moe` on the
layers that ``mlp_layer_types`` marks ``"sparse"`` and a dense SwiGLU MLP on the others; with
``mlp_layer_types=None`` every layer is dense. :meth:`DSAConfig.from_hf_dict` fills
``mlp_layer_types`` as transformers does (``first_k_dense_replace`` dense layers, then MoE,
:func:`moe_layer_schedule`), and so do the full-size presets (``glm5``, ``glm5.2``,
``deepseek-v3.2``: 3 dense layers, then 256-expert MoE); the tiny ones stay dense.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax_dsa.nn.rope_parameters import RopeParameters

INDEXER_TYPES = ("full", "shared")
MLP_LAYER_TYPES = ("dense", "sparse")


def indexer_schedule(
    num_hidden_layers: int, index_topk_freq: int = 1, index_skip_topk_offset: int = 2
) -> tuple[str, ...]:
    """GLM-5.2 IndexShare schedule: layer ``i`` is ``"full"`` iff
    ``max(i + 1 - offset, 0) % freq == 0``, else ``"shared"`` (reuses the previous full layer's
    top-k). Source: transformers ``GlmMoeDsaConfig.__post_init__``; IndexCache, arXiv:2603.12201.
    ``freq=1`` makes every layer full.
    """
    freq = max(int(index_topk_freq), 1)
    offset = int(index_skip_topk_offset)
    return tuple(
        "full" if max(i + 1 - offset, 0) % freq == 0 else "shared" for i in range(num_hidden_layers)
    )


def moe_layer_schedule(num_hidden_layers: int, first_k_dense_replace: int) -> tuple[str, ...]:
    """transformers' ``mlp_layer_types`` default (``GlmMoeDsaConfig`` / ``DeepseekV32Config``):
    the first ``first_k_dense_replace`` layers ``"dense"``, the rest ``"sparse"`` (MoE)."""
    n_dense = min(max(int(first_k_dense_replace), 0), num_hidden_layers)
    return ("dense",) * n_dense + ("sparse",) * (num_hidden_layers - n_dense)


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """A DSA (MLA + lightning indexer) decoder configuration, in Hugging Face field names.

    Hashable (tuples, nested frozen dataclass) so that it can live in Flax NNX static state.

    Main-attention fields: ``num_attention_heads`` heads; q path ``hidden -> q_lora_rank ->
    heads x (qk_nope_head_dim + qk_rope_head_dim)``; kv path ``hidden -> kv_lora_rank +
    qk_rope_head_dim``; ``kv_b_proj`` expands the latent to ``heads x (qk_nope_head_dim +
    v_head_dim)``. ``rope_interleave`` selects pairwise (GPT-J) RoPE for MLA (true for both model
    families). Indexer: ``index_n_heads`` x ``index_head_dim``, RoPE on its first
    ``qk_rope_head_dim`` dims, interleaved iff ``indexer_rope_interleave`` (GLM: true,
    DeepSeek V3.2: false), ``index_topk`` keys per query. ``indexer_types`` (one of ``"full"``
    / ``"shared"`` per layer) defaults to :func:`indexer_schedule` of ``index_topk_freq`` and
    ``index_skip_topk_offset`` (GLM-5.2 IndexShare).

    Raises:
      ValueError: inconsistent dimensions, unknown indexer types, or a first layer that is not
        ``"full"``.
    """

    model_type: str = "glm_moe_dsa"
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    rope_parameters: RopeParameters = RopeParameters(rope_theta=1e6)
    rope_interleave: bool = True
    attention_bias: bool = False
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # Lightning indexer (DSA).
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    indexer_rope_interleave: bool = True
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    indexer_types: tuple[str, ...] | None = None
    # MoE: built on the layers that mlp_layer_types marks "sparse" (None: every layer dense).
    # MTP (num_nextn_predict_layers) is recorded, not built.
    mlp_layer_types: tuple[str, ...] | None = None
    first_k_dense_replace: int = 3
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_nextn_predict_layers: int = 1

    def __post_init__(self):
        if self.indexer_types is None:
            types = indexer_schedule(
                self.num_hidden_layers, self.index_topk_freq, self.index_skip_topk_offset
            )
        else:
            types = tuple(self.indexer_types)
        object.__setattr__(self, "indexer_types", types)
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "v_head_dim", "index_topk", "index_n_heads", "index_head_dim",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DSAConfig: {name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim < 0 or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"DSAConfig: qk_rope_head_dim must be even and >= 0, got {self.qk_rope_head_dim}"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"DSAConfig: the indexer ropes its first qk_rope_head_dim={self.qk_rope_head_dim} "
                f"dims, so index_head_dim={self.index_head_dim} must be at least that"
            )
        if len(types) != self.num_hidden_layers:
            raise ValueError(
                f"DSAConfig: indexer_types has {len(types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if any(t not in INDEXER_TYPES for t in types):
            raise ValueError(
                f"DSAConfig: indexer_types entries must be in {INDEXER_TYPES}, got {types}"
            )
        if types[0] != "full":
            raise ValueError("DSAConfig: layer 0 must be a 'full' indexer layer (nothing to share)")
        if not isinstance(self.rope_parameters, RopeParameters):
            raise TypeError(
                "DSAConfig: rope_parameters must be a RopeParameters (use "
                "RopeParameters.from_hf_dict for an HF dict)"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"DSAConfig: only hidden_act='silu' is built, got {self.hidden_act!r}")
        self._check_moe()

    def _check_moe(self):
        if self.mlp_layer_types is None:
            return
        types = tuple(self.mlp_layer_types)
        object.__setattr__(self, "mlp_layer_types", types)
        if len(types) != self.num_hidden_layers or any(t not in MLP_LAYER_TYPES for t in types):
            raise ValueError(
                f"DSAConfig: mlp_layer_types must have num_hidden_layers={self.num_hidden_layers} "
                f"entries from {MLP_LAYER_TYPES}, got {types}"
            )
        if "sparse" not in types:
            return
        self.check_routed_experts()

    def check_routed_experts(self):
        """The routed-expert fields a MoE block needs (checked at construction when
        ``mlp_layer_types`` has a ``"sparse"`` layer, and by :class:`~jax_dsa.models.glm.moe.MoE`).

        Raises:
          ValueError: a non-positive size or count, experts that do not split into ``n_group``
            groups of at least 2, ``topk_group > n_group``, more experts per token than the
            ``topk_group`` groups hold, or a ``scoring_func`` other than ``"sigmoid"``.
        """
        for name in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                     "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DSAConfig: {name} must be a positive int, got {value!r}")
        if self.n_shared_experts < 0:
            raise ValueError(
                f"DSAConfig: n_shared_experts must be >= 0, got {self.n_shared_experts}"
            )
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                f"DSAConfig: n_routed_experts={self.n_routed_experts} must split into n_group="
                f"{self.n_group} groups of at least 2 experts (a group scores by its top 2)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"DSAConfig: topk_group={self.topk_group} > n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(
                f"DSAConfig: num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                f"topk_group={self.topk_group} groups"
            )
        if self.scoring_func != "sigmoid":
            raise ValueError(
                "DSAConfig: only scoring_func='sigmoid' routing is built, got "
                f"{self.scoring_func!r}"
            )

    # Derived quantities ------------------------------------------------------------------------

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters.rope_theta

    @property
    def qk_head_dim(self) -> int:
        """Un-absorbed query/key head width ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def d_qk(self) -> int:
        """Absorbed (MQA-form) query/key row width ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def d_v(self) -> int:
        """Absorbed value width: the latent ``kv_lora_rank`` (first ``d_v`` columns of a row)."""
        return self.kv_lora_rank

    @property
    def softmax_scale(self) -> float:
        """Attention ``sm_scale``: the un-absorbed ``qk_head_dim ** -0.5`` times YaRN's
        ``mscale(factor, mscale_all_dim) ** 2`` (transformers ``DeepseekV3Attention.scaling``).
        GLM-5: 1/16; DeepSeek V3.2: ``192 ** -0.5 * (0.1 ln 40 + 1) ** 2``."""
        return self.qk_head_dim**-0.5 * self.rope_parameters.softmax_mscale

    @property
    def indexer_weight_scale(self) -> float:
        """Constant on the indexer head weights: ``index_n_heads ** -0.5 * index_head_dim **
        -0.5`` (DeepSeek-V3.2 reference ``Indexer``: ``n_heads^-0.5`` and ``softmax_scale``)."""
        return self.index_n_heads**-0.5 * self.index_head_dim**-0.5

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """Layers that own an indexer and compute their own top-k."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def shared_indexer_layers(self) -> tuple[int, ...]:
        """Layers that reuse the previous full layer's top-k (no indexer parameters)."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "shared")

    def has_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types[layer_idx] == "full"

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the MoE block (``mlp_layer_types`` ``"sparse"``)."""
        return self.mlp_layer_types is not None and self.mlp_layer_types[layer_idx] == "sparse"

    # Conversion --------------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> DSAConfig:
        """Build from a Hugging Face ``config.json`` dict (unknown keys are ignored).

        Accepts ``rope_parameters`` or the older ``rope_scaling`` plus ``rope_theta``, and
        ``index_topk_pattern`` (``"FSS..."``) as transformers does. Without ``mlp_layer_types``,
        the first ``first_k_dense_replace`` layers are dense and the rest MoE (transformers'
        ``GlmMoeDsaConfig`` / ``DeepseekV32Config``).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and v is not None}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        kw["rope_parameters"] = RopeParameters.from_hf_dict(rope, d.get("rope_theta"))
        if d.get("indexer_types") is None and d.get("index_topk_pattern") is not None:
            pattern = d["index_topk_pattern"]
            kw["indexer_types"] = tuple(
                {"F": "full", "S": "shared"}[c] for c in pattern
            ) if isinstance(pattern, str) else tuple(pattern)
        elif d.get("indexer_types") is not None:
            kw["indexer_types"] = tuple(d["indexer_types"])
        if d.get("mlp_layer_types") is None:
            n_dense = d.get("first_k_dense_replace")
            kw["mlp_layer_types"] = moe_layer_schedule(
                kw.get("num_hidden_layers", cls.num_hidden_layers),
                cls.first_k_dense_replace if n_dense is None else n_dense)
        if d.get("rope_interleave") is None:
            kw.pop("rope_interleave", None)
        if d.get("indexer_rope_interleave") is None:
            # transformers: GLM-MoE-DSA interleaves the indexer RoPE, DeepSeek V3.2 does not.
            kw["indexer_rope_interleave"] = d.get("model_type") != "deepseek_v32"
        return cls(**kw)


# Presets ---------------------------------------------------------------------------------------

_GLM5 = DSAConfig(
    model_type="glm_moe_dsa",
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    num_hidden_layers=78,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    rms_norm_eps=1e-5,
    max_position_embeddings=202752,
    rope_parameters=RopeParameters(rope_type="default", rope_theta=1e6),
    rope_interleave=True,
    index_topk=2048,
    index_n_heads=32,
    index_head_dim=128,
    indexer_rope_interleave=True,
    mlp_layer_types=moe_layer_schedule(78, 3),
    first_k_dense_replace=3,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
)

_GLM52 = dataclasses.replace(
    _GLM5,
    max_position_embeddings=1048576,
    rope_parameters=RopeParameters(rope_type="default", rope_theta=8e6),
    index_topk_freq=4,
    index_skip_topk_offset=3,
    indexer_types=None,
)

_DEEPSEEK_V32 = DSAConfig(
    model_type="deepseek_v32",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope_parameters=RopeParameters(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    rope_interleave=True,
    index_topk=2048,
    index_n_heads=64,
    index_head_dim=128,
    indexer_rope_interleave=False,
    mlp_layer_types=moe_layer_schedule(61, 3),
    first_k_dense_replace=3,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
)

# Tiny, byte-level versions for CPU tests and the training example (same attention structure,
# same flags; every layer a dense MLP: mlp_layer_types=None).
_TINY = dict(
    mlp_layer_types=None,
    vocab_size=256,
    hidden_size=128,
    intermediate_size=320,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_topk=64,
    index_n_heads=4,
    index_head_dim=32,
    first_k_dense_replace=0,
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_nextn_predict_layers=0,
)

_GLM5_TINY = dataclasses.replace(
    _GLM5,
    num_hidden_layers=2,
    max_position_embeddings=4096,
    rope_parameters=RopeParameters(rope_type="default", rope_theta=10000.0),
    indexer_types=None,
    **_TINY,
)

_GLM52_TINY = dataclasses.replace(
    _GLM52,
    num_hidden_layers=4,
    max_position_embeddings=4096,
    rope_parameters=RopeParameters(rope_type="default", rope_theta=10000.0),
    index_topk_freq=2,
    index_skip_topk_offset=1,  # full layers 0, 2; shared layers 1, 3
    indexer_types=None,
    **_TINY,
)

_DEEPSEEK_V32_TINY = dataclasses.replace(
    _DEEPSEEK_V32,
    num_hidden_layers=2,
    max_position_embeddings=512,
    rope_parameters=RopeParameters(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=128,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    indexer_types=None,
    n_group=1,
    topk_group=1,
    **_TINY,
)

# A small byte-level GLM-5 with the real latent widths (d_qk 576, d_v 512) and index head width
# (128), so that every GPU kernel (implementation="cuda") runs it: for GPU runs of the training
# example.
_GLM5_SMALL = dataclasses.replace(
    _GLM5_TINY,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    index_topk=256,
    index_n_heads=8,
    index_head_dim=128,
    indexer_types=None,
)

PRESETS: dict[str, DSAConfig] = {
    "glm5": _GLM5,
    "glm5.2": _GLM52,
    "deepseek-v3.2": _DEEPSEEK_V32,
    "glm5-tiny": _GLM5_TINY,
    "glm5.2-tiny": _GLM52_TINY,
    "deepseek-v3.2-tiny": _DEEPSEEK_V32_TINY,
    "glm5-small": _GLM5_SMALL,
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def get_glm_config(name: str, **overrides: Any) -> DSAConfig:
    """The preset ``name`` (one of :data:`PRESET_NAMES`), with optional field overrides.

    Overriding ``num_hidden_layers`` without ``indexer_types`` re-derives the IndexShare schedule
    for the new depth; without ``mlp_layer_types``, a preset with MoE layers gets
    :func:`moe_layer_schedule` for the new depth (an all-dense one stays dense).

    Raises:
      KeyError: an unknown preset name (the message lists the known ones).
    """
    try:
        config = PRESETS[name]
    except KeyError:
        raise KeyError(f"get_glm_config: unknown preset {name!r}; known: {PRESET_NAMES}") from None
    if overrides:
        if "num_hidden_layers" in overrides and "indexer_types" not in overrides:
            overrides["indexer_types"] = None  # re-derive the schedule for the new depth
        if ("num_hidden_layers" in overrides and "mlp_layer_types" not in overrides
                and config.mlp_layer_types is not None):
            overrides["mlp_layer_types"] = moe_layer_schedule(
                overrides["num_hidden_layers"],
                overrides.get("first_k_dense_replace", config.first_k_dense_replace))
        config = dataclasses.replace(config, **overrides)
    return config


__all__ = [
    "INDEXER_TYPES",
    "MLP_LAYER_TYPES",
    "DSAConfig",
    "PRESETS",
    "PRESET_NAMES",
    "get_glm_config",
    "indexer_schedule",
    "moe_layer_schedule",
]
