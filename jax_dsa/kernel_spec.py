"""What the CUDA kernels of ``jax_dsa._cuda`` are compiled for: the one list of their variants.

The build compiles one kernel per variant ahead of time (``ffi/cuda/export/export_*.py``, CuTe
DSL) and generates the handlers' dispatch tables from the same values; the ``"cuda"``
implementation of ``sparse_mla`` pads each call to a compiled variant and refuses the rest. Both
read this module.

The export scripts load this file by path (``importlib``), in a build environment that need not
have jax: it must import nothing beyond the standard library. A change of a value re-runs the
export step on the next build (``ffi/cuda/CMakeLists.txt``); ``_cuda.compiled_variants()`` reports
what a built module holds, and ``tests/test_kernel_spec.py`` compares it with these values.
"""

SPARSE_MLA_HEADS: tuple[int, ...] = (64, 128)
"""Query heads of the SM90 forward and backward kernels, ascending. The kernels work on tiles of
64 heads (one wgmma M); a call with fewer heads is padded up to the next entry (zero q, sink
-inf) and sliced back. 64: GLM-5 and DeepSeek V4-Flash, 128: DeepSeek V3.2 and V4-Pro
(``num_attention_heads`` in ``jax_dsa/models/*/config.py``; DeepSeek V3.2's ``config.json``:
https://huggingface.co/deepseek-ai/DeepSeek-V3.2-Exp)."""

SPARSE_MLA_D_QK: tuple[int, ...] = (512, 576)
"""Query/key widths D_qk (one compiled kernel each). 576 = MLA's 512-wide latent plus its 64-wide
shared rope part (``kv_lora_rank`` + ``qk_rope_head_dim`` of DeepSeek V3.2; FlashMLA's sparse
prefill, https://github.com/deepseek-ai/FlashMLA, takes the same); 512: DeepSeek V4's shared
K = V row of ``head_dim`` 512 with the rope inside it (``jax_dsa/models/deepseek_v4/config.py``)."""

SPARSE_MLA_D_V = 512
"""Value width d_v of every kernel: the first 512 columns of each key row (MLA's latent; all of a
V4 row)."""

SPARSE_MLA_FWD_K_MULTIPLE = 4
"""The forward's slot count K must be a multiple of this (the glue pads with -1): the kernel
fetches each query's row of int32 slot ids in 16-byte blocks. A property of the kernel's code
(``ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py``), not a build choice; the handler checks it."""

DSA_BWD_SLOT_BUCKETS: tuple[int, ...] = (128, 256, 512, 640, 1024, 1152, 2048)
"""Slot widths K of the SM90 backward (the cuDNN frontend's DSA backward,
https://github.com/NVIDIA/cudnn-frontend, compiled once per width as its ``max_topk``), ascending.
Indices are padded with -1 to the smallest width >= K and ``topk_length`` stops each row at its
valid count, so padding costs memory, not work. Past the last bucket one wide variant per
(H, D_qk), with K a run-time size, takes any width unpadded (the kernel's ``max_topk`` only clamps
``topk_length``): the dense warm-up's and V4's HCA wide rows (``128 + S / 128`` slots). 2048: DSA's ``index_topk`` (GLM-5, DeepSeek
V3.2); 640 and 1152: a 128-row window plus the ``index_topk`` 512 or 1024 compressed slots of the
V4-Flash and V4-Pro CSA layers; 128: window-only layers; 256, 512 and 1024 fill the ladder."""

DSA_BWD_SM100_SLOT_BUCKETS: tuple[int, ...] = (512, 640, 2048)
"""Slot widths of the SM100/SM103 backward exported as compile-only artifacts
(``jax_dsa/kernels/sm100``, never linked): a subset of :data:`DSA_BWD_SLOT_BUCKETS`, kept short
for build time."""
