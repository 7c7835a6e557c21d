"""The public DSA ops, one package each (:mod:`~jax_dsa.ops.sparse_mla`,
:mod:`~jax_dsa.ops.dense_mla`, :mod:`~jax_dsa.ops.indexer`), each choosing among the
implementations of its registry (:mod:`~jax_dsa.ops.registry`)."""
