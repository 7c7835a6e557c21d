"""The public DSA ops, one package each, each choosing among the implementations of its registry
(:mod:`~jax_dsa.ops.registry`): :mod:`~jax_dsa.ops.sparse_mla`, :mod:`~jax_dsa.ops.dense_mla`,
:mod:`~jax_dsa.ops.sparse_dense_mla` (built on the first two) and the indexer's ops
(:mod:`~jax_dsa.ops.indexer`). Shared by them: :mod:`~jax_dsa.ops.checks` (argument checks),
:mod:`~jax_dsa.ops.blocks` (query blocks, accumulation dtype), :mod:`~jax_dsa.ops.visibility`."""
