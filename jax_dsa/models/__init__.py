"""The model families, one package each, on the shared blocks of :mod:`jax_dsa.nn`:

* :mod:`jax_dsa.models.glm`: GLM-5, GLM-5.2 and DeepSeek V3.2 (MLA with the lightning indexer,
  IndexShare, sigmoid-routed MoE; transformers' ``glm_moe_dsa`` / ``deepseek_v32``).
* :mod:`jax_dsa.models.deepseek_v4`: DeepSeek V4 (sliding window, CSA and HCA attention,
  hyper-connections, hash and top-k routed MoE, multi-token prediction; ``deepseek_v4``).

Each holds its config, layers, language model and checkpoint names and loaders. The public entry
points stay :mod:`jax_dsa.configs` (``get_config``), :mod:`jax_dsa.nn` (every layer by name) and
:mod:`jax_dsa.interop` (``load_hf``, ``save_hf``). Nothing is imported here.
"""
