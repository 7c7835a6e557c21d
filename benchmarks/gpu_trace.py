"""Moved to :mod:`benchmarks.common`; kept only for ``gpu_indexer_topk.py`` until it moves to
``benchmarks/ops/`` and imports ``benchmarks.common`` (then delete this file)."""

from benchmarks.common import kernel_times  # noqa: F401
