"""RoPE parameters shared by the model families (exported by :mod:`jax_dsa.configs` too).

:class:`RopeParameters` is Hugging Face's ``rope_parameters`` (formerly ``rope_scaling``) dict as
transformers reads it for DeepSeek-style MLA (``DeepseekV3Attention``), with YaRN (Peng et al.,
2023, arXiv:2309.00071). Both :mod:`jax_dsa.models.glm.config` and
:mod:`jax_dsa.models.deepseek_v4.config` import it from here, so that neither family imports the
other and :mod:`jax_dsa.configs` can import both; :mod:`jax_dsa.nn.rope` computes the frequencies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``).

    Source: YaRN (Peng et al., 2023, arXiv:2309.00071) as written in DeepSeek-V3's
    ``inference/model.py`` and transformers' ``yarn_get_mscale``.
    """
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """Hugging Face ``rope_parameters`` (formerly ``rope_scaling``) for the MLA / indexer RoPE.

    Attributes:
      rope_type: ``"default"`` (plain RoPE) or ``"yarn"``.
      rope_theta: RoPE base.
      factor: YaRN context-extension factor (``"yarn"`` only).
      original_max_position_embeddings: pre-extension context length (``"yarn"`` only).
      beta_fast, beta_slow: YaRN correction-range rotation counts (defaults 32 / 1).
      mscale, mscale_all_dim: DeepSeek's YaRN temperature knobs. ``cos``/``sin`` are scaled by
        ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the softmax scale by
        ``mscale(factor, mscale_all_dim) ** 2`` (transformers ``DeepseekV3Attention``).
      attention_factor: explicit ``cos``/``sin`` scale overriding the one above.
      truncate: round the correction range to whole dims (transformers' default ``True``).
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RopeParameters: rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}"
            )
        if not self.rope_theta > 1:
            raise ValueError(f"RopeParameters: rope_theta must be > 1, got {self.rope_theta}")
        if self.rope_type == "yarn":
            if self.factor is None or not self.factor >= 1:
                raise ValueError(f"RopeParameters: yarn needs factor >= 1, got {self.factor}")
            if not self.original_max_position_embeddings:
                raise ValueError(
                    "RopeParameters: yarn needs original_max_position_embeddings (a positive int)"
                )

    @property
    def cos_sin_scale(self) -> float:
        """Factor on ``cos`` and ``sin`` (transformers' ``attention_scaling``); 1 for plain RoPE."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """Factor on the attention softmax scale: ``mscale(factor, mscale_all_dim) ** 2`` or 1."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], rope_theta: float | None = None) -> RopeParameters:
        """From an HF ``rope_parameters`` / ``rope_scaling`` dict (``type`` or ``rope_type``)."""
        rope_type = d.get("rope_type", d.get("type", "default"))
        theta = d.get("rope_theta", rope_theta if rope_theta is not None else 10000.0)
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw.update(rope_type=rope_type, rope_theta=float(theta))
        for name in ("beta_fast", "beta_slow"):  # HF treats None / 0 as "use the default"
            if not kw.get(name):
                kw.pop(name, None)
        return cls(**kw)


__all__ = ["ROPE_TYPES", "RopeParameters", "yarn_get_mscale"]
