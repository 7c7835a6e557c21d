"""GLM-5 / GLM-5.2 / DeepSeek V3.2: DSA attention (MLA in absorbed form over the lightning
indexer's top-k), MoE and the decoder-only language model, in transformers' names
(``GlmMoeDsaForCausalLM``, ``DeepseekV32ForCausalLM``).

* :mod:`~jax_dsa.models.glm.config`: :class:`DSAConfig`, the presets, ``indexer_schedule``.
* :mod:`~jax_dsa.models.glm.indexer`: the lightning indexer (scores and top-k).
* :mod:`~jax_dsa.models.glm.attention`: ``DSAAttention`` (MLA + indexer, sparse or dense).
* :mod:`~jax_dsa.models.glm.moe`: the sigmoid router with group-limited top-k, and ``MoE``.
* :mod:`~jax_dsa.models.glm.model`: ``DecoderLayer`` and ``DSALanguageModel``.
* :mod:`~jax_dsa.models.glm.hf_config`: ``config.json`` <-> :class:`DSAConfig`.
* :mod:`~jax_dsa.models.glm.hf_names`: state path <-> checkpoint key.
* :mod:`~jax_dsa.models.glm.checkpoint`: loading a whole model or one attention layer.

Nothing is imported here: use the modules, or :mod:`jax_dsa.nn`, :mod:`jax_dsa.configs` and
:mod:`jax_dsa.interop`, which export the public names.
"""
