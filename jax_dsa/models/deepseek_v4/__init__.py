"""DeepSeek V4: attention over a sliding window plus compressed entries (CSA with its indexer,
HCA), hyper-connections, hash and top-k routed MoE, multi-token prediction and the
decoder-only language model, in the names of transformers' ``DeepseekV4ForCausalLM``.

* :mod:`~jax_dsa.models.deepseek_v4.config`: ``DeepseekV4Config``, the layer types, the presets.
* :mod:`~jax_dsa.models.deepseek_v4.rope`: RoPE on the last ``qk_rope_head_dim`` dims.
* :mod:`~jax_dsa.models.deepseek_v4.compression_layout`: where a row's compressed entries come
  from and the gated pooling that makes them (functions, no parameters).
* :mod:`~jax_dsa.models.deepseek_v4.indexer`: the CSA indexer (top-k over compressed entries).
* :mod:`~jax_dsa.models.deepseek_v4.compressor`: ``V4Compressor``, the module with the
  compressor's parameters (and, for CSA, its indexer).
* :mod:`~jax_dsa.models.deepseek_v4.slots`: the slot lists (window plus compressed entries).
* :mod:`~jax_dsa.models.deepseek_v4.attention`: ``DeepseekV4Attention``.
* :mod:`~jax_dsa.models.deepseek_v4.hyper`: the hyper-connections (mHC) and the hyper head.
* :mod:`~jax_dsa.models.deepseek_v4.moe`: ``DeepseekV4MoE``.
* :mod:`~jax_dsa.models.deepseek_v4.decoder`: ``DeepseekV4DecoderLayer``.
* :mod:`~jax_dsa.models.deepseek_v4.mtp`: the multi-token-prediction layers.
* :mod:`~jax_dsa.models.deepseek_v4.model`: ``DeepseekV4LanguageModel``.
* :mod:`~jax_dsa.models.deepseek_v4.checkpoint_layouts`: every on-disk layout read under
  transformers' ``state_dict`` names (FP8 / MXFP4 dequantised).
* :mod:`~jax_dsa.models.deepseek_v4.checkpoint`: loading and saving whole models, loading one
  attention layer.

Nothing is imported here: use the modules, or :mod:`jax_dsa.nn`, :mod:`jax_dsa.configs` and
:mod:`jax_dsa.interop`, which export the public names.
"""
