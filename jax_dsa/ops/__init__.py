"""The public DSA ops, one package each (:mod:`~jax_dsa.ops.sparse_mla`,
:mod:`~jax_dsa.ops.dense_mla`, :mod:`~jax_dsa.ops.indexer`), each choosing among the
implementations of its registry (:mod:`~jax_dsa.ops.registry`), and
:mod:`~jax_dsa.ops.sparse_dense_mla`, built on the first two."""
