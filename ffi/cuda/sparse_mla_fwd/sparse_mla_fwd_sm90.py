"""SM90 sparse MLA prefill forward (FlashMLA v2 contract), written with CuTe DSL.

Build-time module: ``ffi/cuda/export/export_sparse_mla_fwd.py`` compiles :class:`SparseMlaFwdSm90`
ahead of time for ``sm_90a`` and exports it as a C object; nothing here runs at run time.

Contract (one launch, flat tokens):
  q ``[S_q, H, D_qk]`` bf16 (H a multiple of 64), kv ``[S_kv, D_qk]`` bf16 (V = first 512
  columns), indices ``[S_q, K]`` int32 (K a multiple of 4: a row of ids is one bulk prefetch),
  topk_length ``[S_q]`` int32 (slots at or past it are ignored), attn_sink ``[H]`` float32
  (-inf = none), sm_scale.
  out ``[S_q, H, 512]`` bf16 = softmax-weighted V rows, scaled by exp(lse)/(exp(lse)+exp(sink));
  lse ``[S_q, H]`` float32 = natural-log logsumexp of sm_scale * q.k over valid slots (sink-free);
  max_logits ``[S_q, H]`` float32 = sm_scale * max q.k. A slot is valid iff its position is below
  topk_length and 0 <= index < S_kv; invalid slots are never read (their shared-memory rows are
  zero-filled). Rows with no valid slot: out 0, lse +inf, max_logits -inf.
  n_ctas: the grid size (the caller passes the SM count); CTA b walks the tiles
  b, b + n_ctas, ... (a tile = one query token and 64 heads).

Schedule (the FlashMLA SM90 idea, our own code): persistent CTAs of three warpgroups. The
producer WG gathers kv rows by index into shared memory with 16-byte cp.async (zero-fill for
invalid slots, never read) into two 64-row stages, each filled in two
parts guarded by their own mbarriers, and writes each slot's validity (and per warp whether all
its rows are valid) next to them. The two consumer WGs ping-pong over blocks: WG w computes
S = Q K^T (wgmma m64n64, M = 64 heads) and the softmax of the blocks n = w, w + 2, ..., and
each WG owns the output columns [256 w, 256 w + 256) of every block (a 64 x 256 fp32
accumulator). The running row max is a chain through shared memory: block n's owner takes M_n
from the other WG's block n - 1 and publishes M_{n+1}; it keeps P in registers for its own P V
and leaves a copy as plain words (D_qk 576: in the stage's rope columns, which no one reads
after S; 512: a room of its own) that the other WG loads into the same registers for its P V
(both register-A wgmma), then signals it on an mbarrier (release / acquire). P goes over in
four parts of 16 kv rows, each with its own mbarrier, and each part's P V (on both WGs) is issued
as soon as the part is out, so it runs while the softmax computes the next part. The other WG's
P V of block n - 1 is issued between the two halves of S_n, so the stage part it reads goes
back to the producer as soon as it is done. The max moves only when a block's exceeds it by
more than 2^8 in P, so O is rarely rescaled, and the row max's shuffles are skipped when no
thread of a warp holds a logit past that threshold (a warp vote); what that usual case needs is
computed before S is done, and the other WG skips its rescale when the max stayed. Stage parts
are released as soon as their readers are done: the owner's V half after its own P V, the other
half (and P) after the other WG's.
Between tiles: the producer loads the next tile's Q as soon as both WGs' last S of the tile is
done (mbarrier q_empty), and prefetches its kv row ids and first blocks while the consumers
finish; the next tile's row ids are prefetched into L2 when a tile starts. Both WGs stage the
output in stage 1 (mbarrier o_full); WG0 goes on to the next tile, and WG1 stores the output with
16-byte stores once the next Q has landed, then hands stage 1 back to the producer (mbarrier
o_empty). L2 eviction policies keep the kv rows (reused by many queries) and let q,
out and the row ids stream through.
Math: online softmax in base 2 with the max kept in raw logits (Milakov & Gimelshein 2018;
FlashAttention-2, Dao 2023), with FlashAttention-4's conditional rescaling
(Dao-AILab/flash-attention, flash_attn/cute).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

try:
    from cutlass.tensor_utils import LayoutEnum
except ModuleNotFoundError:  # older wheels
    from cutlass.utils import LayoutEnum
try:
    from cutlass.memory import SmemAllocator
except ModuleNotFoundError:
    from cutlass.utils import SmemAllocator

D_V = 512
TILE_M = 64  # heads per CTA (the wgmma M)
TILE_N = 64  # kv rows per block
STAGES = 2
HALF = D_V // 2  # output columns per consumer warpgroup
O_ROW = HALF + 8  # staged output row (elements): 16 bytes of padding keep the stores conflict-free
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# P is handed over in parts of one k step (16 kv rows) each: a part's P V runs while the softmax
# computes the next part.
P_PARTS = 4


@dsl_user_op
def _cp_async_16(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32, policy: Int64, *,
                 loc=None, ip=None):
    """16-byte cp.async (L2 only, with an L2 eviction policy); src_bytes 0 writes zeros without
    reading global memory."""
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
         Int32(src_bytes).ir_value(loc=loc, ip=ip), Int64(policy).ir_value(loc=loc, ip=ip)],
        "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2, $3;",
        "r,l,r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def _l2_policy(kind: str, *, loc=None, ip=None) -> Int64:
    """L2 eviction policy ("evict_last" or "evict_first"): evict_last for kv rows (reused by many
    queries); evict_first for what passes through once (the Q load, out, the prefetched kv row
    ids), so that it does not push kv out of L2."""
    return Int64(llvm.inline_asm(
        T.i64(), [], f"createpolicy.fractional.L2::{kind}.b64 $0, 1.0;", "=l",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def _copy_16_to_global(gmem_addr: Int64, smem_addr: Int32, policy: Int64, *, loc=None, ip=None):
    """16 bytes from shared to global memory through registers (ld.shared + st.global, with an
    L2 eviction policy); the store is not waited for."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(smem_addr).ir_value(loc=loc, ip=ip),
         Int64(policy).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 a, b, c, d;\n\tld.shared.v4.b32 {a, b, c, d}, [$1];\n\t"
        "st.global.L2::cache_hint.v4.b32 [$0], {a, b, c, d}, $2;\n\t}",
        "l,r,l", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _prefetch_l2(gmem_addr: Int64, nbytes: Int32, policy: Int64, *, loc=None, ip=None):
    """Bulk prefetch of nbytes contiguous bytes (16-byte aligned) from global memory into L2,
    with an L2 eviction policy."""
    llvm.inline_asm(
        None,
        [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip),
         Int64(policy).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [$0], $1, $2;",
        "l,r,l", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _barrier_sync(barrier_id: int, n_threads: int, *, loc=None, ip=None):
    """Named barrier, non-aligned form: the two consumer WGs reach it from different code."""
    llvm.inline_asm(None, [], f"barrier.sync {barrier_id}, {n_threads};", "",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _lg2(a: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip)], "lg2.approx.f32 $0, $1;", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def _ex2(a: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def _ldmatrix_x4(smem_addr: Int32, *, loc=None, ip=None):
    """ldmatrix .x4: four 8x8 b16 matrices (rows addressed by lanes 0-7, 8-15, 16-23, 24-31) as
    four 32-bit words, the m16 k16 A fragment of an MMA in word order."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32(), T.i32(), T.i32()]),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


def _tree_max(vals):
    """fmax of a list of values as a balanced tree (dependent depth log2 n, not n)."""
    vals = list(vals)
    while len(vals) > 1:
        nxt = [cute.arch.fmax(vals[k], vals[k + 1]) for k in range(0, len(vals) - 1, 2)]
        if len(vals) % 2:
            nxt.append(vals[-1])
        vals = nxt
    return vals[0]


def _smem_layout(shape):
    """Row-major (K-major) bf16 tile in the 128-byte-swizzled layout wgmma reads."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, shape[1]), BFloat16)
    return cute.tile_to_shape(atom, shape, order=(0, 1))


def _transpose(t):
    """(a, b) smem tensor viewed as (b, a)."""
    return cute.composition(t, cute.make_ordered_layout((t.shape[1], t.shape[0]), order=(1, 0)))


def _swizzled_byte_offset(row, col, rows):
    """Byte offset of element (row, col) of a [rows, D] tile in _smem_layout (SW128, K-major,
    8-row x 64-column atoms tiled down the rows first): plain offset row*64 + col%64 +
    (col/64)*rows*64 elements, then the 128-byte swizzle (bits 4-6 ^= bits 7-9)."""
    off = (row * 64 + (col % 64) + (col // 64) * (rows * 64)) * 2
    return off ^ ((off >> 3) & 0x70)


_PV_K_STEPS = tuple(range(TILE_N // 16))
assert len(_PV_K_STEPS) % P_PARTS == 0  # each part of P is whole k steps
_STEPS_PER_PART = len(_PV_K_STEPS) // P_PARTS


def _s_k_steps(w: int, d: int):
    """k steps (16 columns each) of WG w's S = Q K^T: its own V half first (that part of a stage
    is refilled first), then the other half and the rope columns."""
    own = tuple(range(16 * w, 16 * w + 16))
    rest = tuple(range(16 * (1 - w), 16 * (1 - w) + 16)) + tuple(range(32, d // 16))
    return own, rest


class SparseMlaFwdSm90:
    """``contiguous``: the dense (causal) mode. Query s's slots are the kv rows
    ``indices[s, 0] + j`` for ``j < topk_length[s]`` (one contiguous run; the other columns of
    ``indices`` are not read) instead of a list of row ids; everything else is the same.

    ``target``: the indexer loss's target (DeepSeek-V3.2 paper §2.1) instead of attention. lse
    ``[S_q, H]`` is an input (the attention's natural-log, sink-free denominators over the same
    slots; +inf for a head that has none) and ``out`` is float32 ``[S_q * H / 64, K_out]``: for
    tile t = (query s, 64-head group g) and slot j,
        out[t, j] = sum_{h in g} exp(sm_scale * q[s, h] . kv[row_j] - lse[s, h])
    (0 for an invalid slot; columns at or past topk_length are not written). Only S = Q K^T
    runs (no P V, no online softmax); max_logits is not touched. The build compiles it over slot
    lists only (``export_sparse_mla_fwd.variants``)."""

    def __init__(self, heads: int, d_qk: int, contiguous: bool = False, target: bool = False):
        assert heads % TILE_M == 0 and d_qk in (512, 576)
        self.h = heads
        self.d = d_qk
        self.contiguous = contiguous
        self.target = target
        self.num_threads = 384
        self.producer_regs = 40
        self.consumer_regs = 232
        # setmaxnreg.inc waits until the CTA's register pool (what the launch gave: 168 per
        # thread at 384 threads) can supply it, so a split past the pool hangs the kernel.
        pool = self.num_threads * (65536 // self.num_threads // 8 * 8)
        consumers = self.num_threads - 128  # every warpgroup but the producer
        need = 128 * self.producer_regs + consumers * self.consumer_regs
        assert need <= pool, (f"producer_regs {self.producer_regs} x 128 + consumer_regs "
                              f"{self.consumer_regs} x {consumers} = {need} exceeds the pool "
                              f"of {pool}")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
                 mSink: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mMax: cute.Tensor,
                 sm_scale: Float32, n_ctas: Int32, stream: cuda.CUstream):
        d = self.d
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, TILE_N))
        mma_rs = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, HALF),
            a_source=warpgroup.OperandSource.RMEM)
        if const_expr(self.target):
            # target mode has no P V: its S = Q K^T takes Q from registers (see _consumer_target)
            mma_rs = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=(TILE_M, TILE_N),
                a_source=warpgroup.OperandSource.RMEM)
        sQ_layout = _smem_layout((TILE_M, d))
        sK_layout = _smem_layout((TILE_N, d))
        sV_layout = _smem_layout((TILE_N, D_V))
        # D_qk 576: P lives in the stage's rope columns; 512 has no rope, so P gets its own room.
        p_elems = STAGES * TILE_M * TILE_N if d == 512 else 64
        q_elems = TILE_M * d

        @cute.struct
        class Storage:
            full_own: cute.struct.MemRange[cutlass.Int64, STAGES]
            full_rest: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty_own: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty_rest: cute.struct.MemRange[cutlass.Int64, STAGES]
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            q_empty: cute.struct.MemRange[cutlass.Int64, 1]
            o_full: cute.struct.MemRange[cutlass.Int64, 1]  # a tile's output is staged
            o_empty: cute.struct.MemRange[cutlass.Int64, 1]  # ... and copied out of stage 1
            # WG w published M and part j of P of a block: ready[w + 2 j]
            ready: cute.struct.MemRange[cutlass.Int64, 2 * P_PARTS]
            row_max: cute.struct.Align[cute.struct.MemRange[Float32, 2 * TILE_M], 16]
            row_sum: cute.struct.Align[cute.struct.MemRange[Float32, 4 * TILE_M], 16]
            valid: cute.struct.Align[cute.struct.MemRange[Uint8, STAGES * TILE_N], 16]
            # per stage and producer warp: 1 if all 16 of the warp's rows are valid
            all_valid: cute.struct.Align[cute.struct.MemRange[Int32, STAGES * 4], 16]
            true_max: cute.struct.Align[cute.struct.MemRange[Float32, 4 * TILE_M], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, q_elems], 1024]
            sKV0: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE_N * d], 1024]
            sKV1: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE_N * d], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, p_elems], 1024]

        self.storage_cls = Storage
        # persistent: at most n_ctas CTAs (the SM count), each walking tiles bidx, bidx + grid..
        grid = (cutlass.min(mQ.shape[0] * (self.h // TILE_M), n_ctas), 1, 1)
        self.kernel(mQ, mKV, mIdx, mLen, mSink, mOut, mLse, mMax, sm_scale, mma_s, mma_rs,
                    sQ_layout, sK_layout, sV_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=Storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1)

    @cute.jit
    def _mma(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
             k_steps, zero_init: cutlass.Constexpr[bool]):
        """Issue acc (+)= A B^T over the given k steps (no fence, no commit)."""
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in k_steps:
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
               mSink: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mMax: cute.Tensor,
               sm_scale: Float32, mma_s: cute.TiledMma, mma_rs: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout):
        d = self.d
        h = self.h
        n_chunks = d // 64  # 64-column chunks of a row: 4 per V half, then the rope chunk
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tiles = mQ.shape[0] * (h // TILE_M)
        s_kv = mKV.shape[0]
        idx_stride = mIdx.shape[1]
        # the bound of topk_length: the slot list's width, or in contiguous mode the kv rows
        k_slots = s_kv if const_expr(self.contiguous) else idx_stride

        smem = SmemAllocator()
        st = smem.allocate(self.storage_cls)
        full_own = st.full_own.data_ptr()
        full_rest = st.full_rest.data_ptr()
        empty_own = st.empty_own.data_ptr()
        empty_rest = st.empty_rest.data_ptr()
        q_full = st.q_full.data_ptr()
        q_empty = st.q_empty.data_ptr()
        o_full = st.o_full.data_ptr()
        o_empty = st.o_empty.data_ptr()
        ready = st.ready.data_ptr()
        if tidx == 0:
            for i in cutlass.range_constexpr(STAGES):
                # 128 cp.async arrivals + 128 plain arrivals after the validity bytes
                cute.arch.mbarrier_init(full_own + i, 256)
                cute.arch.mbarrier_init(full_rest + i, 128)
                cute.arch.mbarrier_init(empty_own + i, 128)
                cute.arch.mbarrier_init(empty_rest + i, 128)
            cute.arch.mbarrier_init(q_full, 128)
            cute.arch.mbarrier_init(q_empty, 256)  # every consumer thread
            cute.arch.mbarrier_init(o_full, 256)
            cute.arch.mbarrier_init(o_empty, 128)
            for i in cutlass.range_constexpr(2 * P_PARTS):
                cute.arch.mbarrier_init(ready + i, 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = [st.sKV0.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
              st.sKV1.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)]
        sV = [st.sKV0.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
              st.sKV1.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)]
        if const_expr(d == 576):
            # columns 512..575 of a stage: one contiguous 64 x 64 swizzled tile
            p_base = [st.sKV0.data_ptr() + D_V * TILE_N, st.sKV1.data_ptr() + D_V * TILE_N]
        else:
            # stage 1's P room first: the output staging (from stage 1 on) runs into it
            p_base = [st.sP.data_ptr() + TILE_M * TILE_N, st.sP.data_ptr()]
        sValid = cute.make_tensor(st.valid.data_ptr(), cute.make_layout((STAGES, TILE_N),
                                                                        stride=(TILE_N, 1)))
        sAllValid = cute.make_tensor(st.all_valid.data_ptr(), cute.make_layout((STAGES, 4),
                                                                               stride=(4, 1)))

        if warp < 4:
            # ---------------- producer: gather kv rows by index ----------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            r_in = tidx // 8  # 16 rows per pass
            c_in = tidx % 8  # 8 x 16 B = one 64-column chunk of a row per pass
            kv_smem = st.sKV0.data_ptr().toint()
            kv_stage_bytes = Int32(TILE_N * d * 2)
            kv_base = mKV.iterator.toint()
            keep = _l2_policy("evict_last")
            # fills of each stage so far (all tiles): the parity of the next empty wait
            uses = cute.make_rmem_tensor((STAGES,), Int32)
            uses.fill(0)
            # this thread's kv row ids, loaded one block ahead (global load latency off the
            # path); the last block of a tile loads those of the next tile's first block
            nxt = cute.make_rmem_tensor((TILE_N // 16,), Int32)
            pref = cute.make_rmem_tensor((1,), Int32)  # the tile whose block 0 nxt holds
            pref[0] = Int32(-1)
            src = cute.make_rmem_tensor((TILE_N // 16,), Int64)
            nbytes = cute.make_rmem_tensor((TILE_N // 16,), Int32)
            for t in cutlass.range(bidx, n_tiles, n_ctas, unroll=1):
                ti = (t - bidx) // n_ctas
                s = t // (h // TILE_M)
                h0 = (t % (h // TILE_M)) * TILE_M
                n_len = self._len(mLen, s, k_slots)
                n_blk = (n_len + TILE_N - 1) // TILE_N
                if pref[0] != t:
                    self._load_rows(mIdx, s, Int32(0), n_len, r_in, nxt)
                # the Q room is free once the previous tile's last S is done
                self._load_q(mQ, s, h0, ti, r_in, c_in, st.sQ.data_ptr().toint(), q_full,
                             q_empty, n_len)
                if tidx == 0 and t + n_ctas < n_tiles:
                    # the next tile's row ids wait in L2, not HBM, when their turn comes (its Q
                    # is not prefetched: that ran slower at every kv size measured, 16-36 MiB)
                    s_next = (t + n_ctas) // (h // TILE_M)
                    _prefetch_l2(mIdx.iterator.toint() + Int64(s_next) * idx_stride * 4,
                                 idx_stride * 4, _l2_policy("evict_first"))
                n_pair = (n_blk + 1) // 2
                for bp in cutlass.range(n_pair, unroll=1):
                    for stage in cutlass.range_constexpr(STAGES):
                        blk = bp * STAGES + stage
                        if blk < n_blk:
                            cur = cute.make_rmem_tensor((TILE_N // 16,), Int32)
                            for i in cutlass.range_constexpr(TILE_N // 16):
                                cur[i] = nxt[i]
                            self._load_rows(mIdx, s, blk + 1, n_len, r_in, nxt)
                            if blk + 1 == n_blk and t + n_ctas < n_tiles:
                                s_next = (t + n_ctas) // (h // TILE_M)
                                self._load_rows(mIdx, s_next, Int32(0),
                                                self._len(mLen, s_next, k_slots), r_in, nxt)
                                pref[0] = t + n_ctas
                            for i in cutlass.range_constexpr(TILE_N // 16):
                                kv_row = cur[i]
                                ok = kv_row >= 0 and kv_row < s_kv
                                nbytes[i] = Int32(0)
                                src[i] = kv_base
                                if ok:
                                    nbytes[i] = Int32(16)
                                    src[i] = kv_base + Int64(kv_row) * (d * 2)
                            stage_smem = kv_smem + stage * kv_stage_bytes
                            use = uses[stage] + bp
                            if use > 0:
                                cute.arch.mbarrier_wait(empty_own + stage, (use - 1) % 2)
                            if const_expr(stage == 1 and not self.target):
                                if ti > 0 and bp == 0:
                                    # the previous tile's output has left stage 1
                                    cute.arch.mbarrier_wait(o_empty, (ti - 1) % 2)
                            # part 1: the owner's V half (and the slot validity)
                            for i in cutlass.range_constexpr(TILE_N // 16):
                                row = r_in + 16 * i
                                for j in cutlass.range_constexpr(4):
                                    col = (c_in + 8 * (4 * stage + j)) * 8
                                    _cp_async_16(
                                        stage_smem + _swizzled_byte_offset(row, col, TILE_N),
                                        src[i] + col * 2, nbytes[i], keep)
                                if c_in == 0:
                                    sValid[stage, row] = Uint8(nbytes[i] != 0)
                            mine = ((nbytes[0] != 0) and (nbytes[1] != 0) and (nbytes[2] != 0)
                                    and (nbytes[3] != 0))
                            all_ok = cute.arch.vote_all_sync(mine)
                            if tidx % 32 == 0:
                                sAllValid[stage, warp] = Int32(all_ok)
                            cute.arch.cp_async_mbarrier_arrive_noinc(full_own + stage)
                            cute.arch.mbarrier_arrive(full_own + stage)
                            # part 2: the other V half and the rope columns
                            if use > 0:
                                cute.arch.mbarrier_wait(empty_rest + stage, (use - 1) % 2)
                            for i in cutlass.range_constexpr(TILE_N // 16):
                                row = r_in + 16 * i
                                for j in cutlass.range_constexpr(n_chunks - 4):
                                    jj = 4 * (1 - stage) + j if j < 4 else j + 4
                                    col = (c_in + 8 * jj) * 8
                                    _cp_async_16(
                                        stage_smem + _swizzled_byte_offset(row, col, TILE_N),
                                        src[i] + col * 2, nbytes[i], keep)
                            cute.arch.cp_async_mbarrier_arrive_noinc(full_rest + stage)
                if const_expr(not self.target):
                    if ti > 0 and n_blk < 2:
                        # no block of this tile went to stage 1: still wait for every o_empty
                        # phase
                        cute.arch.mbarrier_wait(o_empty, (ti - 1) % 2)
                uses[0] = uses[0] + (n_blk + 1) // 2
                uses[1] = uses[1] + n_blk // 2
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
        else:
            # ---------------- consumers: two warpgroups in ping-pong ----------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = (warp - 4) // 4
            for w in cutlass.range_constexpr(2):
                if const_expr(self.target):
                    if wg == w:
                        self._consumer_target(
                            w, tidx % 128, tidx % 32, bidx, n_ctas, n_tiles, k_slots, sm_scale,
                            mLen, mOut, mLse, mma_rs, st.sQ.data_ptr().toint(), sK, sValid,
                            [st.row_sum.data_ptr(), st.true_max.data_ptr()], full_own,
                            full_rest, empty_own, empty_rest, q_full, q_empty)
                elif wg == w:
                    self._consumer(w, tidx % 128, tidx % 32, bidx, n_ctas, n_tiles, k_slots,
                                   sm_scale, mLen, mSink, mOut, st.sKV1.data_ptr(),
                                   mLse, mMax, mma_s, mma_rs, sQ, sK, sV, p_base, sValid,
                                   sAllValid, st.row_max.data_ptr(), st.row_sum.data_ptr(),
                                   st.true_max.data_ptr(), full_own,
                                   full_rest, empty_own, empty_rest, q_full, q_empty, o_full,
                                   o_empty,
                                   ready)

    @staticmethod
    def _len(mLen: cute.Tensor, s, k_slots):
        """Slots used by query s: topk_length clamped to [0, K]."""
        return cutlass.max(cutlass.min(mLen[s], k_slots), 0)

    @cute.jit
    def _load_q(self, mQ: cute.Tensor, s: Int32, h0: Int32, ti: Int32, r_in: Int32, c_in: Int32,
                q_smem: Int32, q_full, q_empty, n_len: Int32):
        """Copy the tile's 64 x D_qk Q rows into the Q room once the previous tile freed it.
        A tile without slots (n_len 0: the dense chunks' rows that see none of a chunk) reads
        no Q: the room is zero-filled, the barriers run as for any tile."""
        d = self.d
        q_bytes = Int32(16)
        if n_len == 0:
            q_bytes = Int32(0)
        if ti > 0:
            cute.arch.mbarrier_wait(q_empty, (ti - 1) % 2)
        q_row0 = mQ.iterator.toint() + (Int64(s) * self.h + h0) * (d * 2)
        stream_once = _l2_policy("evict_first")
        for i in cutlass.range_constexpr(TILE_M // 16):
            row = r_in + 16 * i
            for j in cutlass.range_constexpr(d // 64):
                col = (c_in + 8 * j) * 8
                _cp_async_16(q_smem + _swizzled_byte_offset(row, col, TILE_M),
                             q_row0 + Int64(row * d + col) * 2, q_bytes, stream_once)
        cute.arch.cp_async_mbarrier_arrive_noinc(q_full)

    @cute.jit
    def _load_rows(self, mIdx: cute.Tensor, s: Int32, blk: Int32, n_len: Int32, r_in: Int32,
                   rows: cute.Tensor):
        """kv row ids of this producer thread's four rows of block blk (-1 past n_len)."""
        first = Int32(0)
        if const_expr(self.contiguous):
            first = mIdx[s, 0]
        for i in cutlass.range_constexpr(TILE_N // 16):
            pos = blk * TILE_N + r_in + 16 * i
            kv_row = Int32(-1)
            if pos < n_len:
                if const_expr(self.contiguous):
                    kv_row = first + pos
                else:
                    kv_row = mIdx[s, pos]
            rows[i] = kv_row

    @cute.jit
    def _consumer(self, w: cutlass.Constexpr[int], wtid: Int32, lane: Int32, bidx: Int32,
                  n_ctas: Int32, n_tiles: Int32, k_slots: Int32, sm_scale: Float32,
                  mLen: cute.Tensor, mSink: cute.Tensor, mOut: cute.Tensor, o_smem,
                  mLse: cute.Tensor, mMax: cute.Tensor, mma_s: cute.TiledMma,
                  mma_rs: cute.TiledMma, sQ, sK, sV, p_base, sValid: cute.Tensor,
                  sAllValid: cute.Tensor, row_max_ptr, row_sum_ptr, true_max_ptr, full_own,
                  full_rest, empty_own, empty_rest, q_full, q_empty, o_full, o_empty,
                  ready):
        d = self.d
        h = self.h
        o = 1 - w  # the other consumer warpgroup (and the stage of its blocks)
        scale_log2 = sm_scale * LOG2E
        thr_s = mma_s.get_slice(wtid)
        thr_rs = mma_rs.get_slice(wtid)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK[w]))
        tOrV_own = thr_rs.make_fragment_B(thr_rs.partition_B(
            cute.local_tile(_transpose(sV[w]), (HALF, TILE_N), (w, 0))))
        tOrV_oth = thr_rs.make_fragment_B(thr_rs.partition_B(
            cute.local_tile(_transpose(sV[o]), (HALF, TILE_N), (w, 0))))
        # P crosses between the WGs as plain 32-bit words, thread t of one WG to thread t of the
        # other (the same fragment position), 16 bytes per access and conflict-free; the reader
        # loads them into registers for a register-A wgmma, so no proxy fence is needed.
        p_words = cute.make_layout((4, 4), stride=(1, 512))
        sP_own = cute.make_tensor(cute.recast_ptr(p_base[w], dtype=Int32) + wtid * 4, p_words)
        sP_oth = cute.make_tensor(cute.recast_ptr(p_base[o], dtype=Int32) + wtid * 4, p_words)
        cS = thr_s.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))

        acc_o = cute.make_rmem_tensor(thr_rs.partition_shape_C((TILE_M, HALF)), Float32)
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((TILE_M, TILE_N)), Float32)
        # P as the register A operand of the P V wgmma: the m64n64 accumulator fragment read as
        # four k16 slices (elements 8k..8k+7 are k slice k), i.e. the same registers in order.
        # It holds this WG's P, or the other WG's P while that block's P V runs.
        rP = cute.make_rmem_tensor(
            cute.make_layout(((2, 2, 2), 1, TILE_N // 16), stride=((1, 2, 4), 0, 8)), BFloat16)
        rP_words = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=Int32),
                                    cute.make_layout((4, 4), stride=(1, 4)))
        # Accumulator element i of a wgmma fragment holds row r0 + 8 * ((i // 2) % 2).
        rows = cute.make_rmem_tensor((2,), Int32)
        rows[0] = cS[0][0]
        rows[1] = cS[2][0]
        m_cur = cute.make_rmem_tensor((2,), Float32)  # row max (raw logits) O is relative to
        l_sum = cute.make_rmem_tensor((2,), Float32)  # this thread's part of the row sum
        sMax = cute.make_tensor(row_max_ptr, cute.make_layout((2, TILE_M), stride=(TILE_M, 1)))
        # per tile parity and WG: row sums and true maxima for the epilogue (two tiles' worth,
        # so a WG that races ahead into the next tile's epilogue cannot overwrite what the
        # other still reads)
        sSum = cute.make_tensor(row_sum_ptr, cute.make_layout((2, 2, TILE_M),
                                                              stride=(2 * TILE_M, TILE_M, 1)))
        sTrue = cute.make_tensor(true_max_ptr, cute.make_layout((2, 2, TILE_M),
                                                                stride=(2 * TILE_M, TILE_M, 1)))
        # the true row max of this WG's blocks (m_cur may lag it, see _own_block)
        m_true = cute.make_rmem_tensor((2,), Float32)
        uses = cute.make_rmem_tensor((STAGES,), Int32)  # blocks of each WG in earlier tiles
        uses.fill(0)

        for t in cutlass.range(bidx, n_tiles, n_ctas, unroll=1):
            ti = (t - bidx) // n_ctas
            s = t // (h // TILE_M)
            h0 = (t % (h // TILE_M)) * TILE_M
            n_blk = (self._len(mLen, s, k_slots) + TILE_N - 1) // TILE_N
            n_own = cutlass.max((n_blk - w + 1) // 2, 0)
            acc_o.fill(0.0)
            m_cur.fill(-math.inf)
            l_sum.fill(0.0)
            m_true.fill(-math.inf)
            cute.arch.mbarrier_wait(q_full, ti % 2)
            if const_expr(w == 1):
                if ti > 0:
                    # the previous tile's output, once this tile's Q is in (see _store_out)
                    self._store_out(mOut, t - n_ctas, ti - 1, wtid, o_full, o_empty, o_smem)
            if n_own == 0 and lane == 0:
                # no S of this WG reads the Q room (one arrival per warp: a uniform branch
                # here makes ptxas serialize the wgmma)
                cute.arch.mbarrier_arrive(q_empty, arrive_count=32)
            st = (w, o, d, acc_s, acc_o, rP, rP_words, tSrQ, tSrK, tOrV_own, tOrV_oth,
                  sP_own, sP_oth, cS, rows, m_cur, m_true, l_sum, sMax, sValid, sAllValid,
                  mma_s, mma_rs, lane, scale_log2, full_own, full_rest, empty_own, empty_rest,
                  ready, uses, n_own, q_empty)
            # Block 0 has no predecessor: WG0's first block is peeled so that no wgmma sits in
            # a data-dependent branch (ptxas would serialize them).
            if const_expr(w == 0):
                if n_own > 0:
                    self._own_block(st, Int32(0), False)
                for it in cutlass.range(1, n_own, unroll=1):
                    self._own_block(st, it, True)
            else:
                for it in cutlass.range(n_own, unroll=1):
                    self._own_block(st, it, True)

            warpgroup.wait_group(0)
            if n_own > 0:
                cute.arch.mbarrier_arrive(empty_own + w)  # the last own block's V half
            if n_blk > 0 and (n_blk - 1) % 2 == o:
                # the last block is the other WG's
                self._other_block(st, (uses[o] + (n_blk - 1) // 2) % 2)
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(empty_rest + o)
            self._epilogue(st, ti, s, h0, sm_scale, mSink, mLse, mMax, o_smem, sSum, sTrue,
                           thr_rs, o_full, o_empty)
            uses[0] = uses[0] + (n_blk + 1) // 2
            uses[1] = uses[1] + n_blk // 2
        if const_expr(w == 1):
            if bidx < n_tiles:
                t_last = bidx + (n_tiles - 1 - bidx) // n_ctas * n_ctas
                self._store_out(mOut, t_last, (t_last - bidx) // n_ctas, wtid, o_full, o_empty,
                                o_smem)

    @cute.jit
    def _consumer_target(self, w: cutlass.Constexpr[int], wtid: Int32, lane: Int32, bidx: Int32,
                         n_ctas: Int32, n_tiles: Int32, k_slots: Int32, sm_scale: Float32,
                         mLen: cute.Tensor, mMass: cute.Tensor, mLse: cute.Tensor,
                         mma_s: cute.TiledMma, q_smem: Int32, sK, sValid: cute.Tensor, red_ptrs,
                         full_own, full_rest, empty_own, empty_rest, q_full, q_empty):
        """Target mode (see the class docstring): WG w takes the blocks n = w, w + 2, ... of each
        tile: S = Q K_n^T over all of D_qk with Q in registers (loaded once a tile, so that the
        wgmma reads only K from shared memory: with Q read from shared memory too, each block's
        S reads 2 x 72 KiB there for 4.7 MFLOP, which bounds it below the tensor-core rate),
        p = exp2(S * sm_scale * log2 e - lse * log2 e) with
        invalid slots 0, the stage handed back, then each slot's sum over the 64 heads: over
        the thread's two rows, the 8 lanes that share its columns (shuffles), and the WG's four
        warps (shared memory, one 128-thread named barrier on each side)."""
        d = self.d
        h = self.h
        scale_log2 = sm_scale * LOG2E
        thr_s = mma_s.get_slice(wtid)
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK[w]))
        # Q as the register A operand: k step k is elements 8k..8k+7 (words 4k..4k+3), the m16 k16
        # fragment of the thread's warp (heads 16 warp..) that one ldmatrix .x4 returns.
        n_k = d // 16
        rQ = cute.make_rmem_tensor(
            cute.make_layout(((2, 2, 2), 1, n_k), stride=((1, 2, 4), 0, 8)), BFloat16)
        rQ_words = cute.make_tensor(cute.recast_ptr(rQ.iterator, dtype=Int32),
                                    cute.make_layout((4, n_k), stride=(1, 4)))
        q_row = 16 * (wtid // 32) + lane % 16  # the row and column half this lane addresses
        q_col = 8 * (lane // 16)
        cS = thr_s.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((TILE_M, TILE_N)), Float32)
        n_s = cute.size(acc_s)
        n_cols = n_s // 2  # the thread's columns: elements i and i + 2 of each group of 4
        rows = cute.make_rmem_tensor((2,), Int32)
        rows[0] = cS[0][0]
        rows[1] = cS[2][0]
        lse2 = cute.make_rmem_tensor((2,), Float32)
        csum = cute.make_rmem_tensor((n_cols,), Float32)
        # [warp of the WG, column] partial sums; this WG's own room
        sRed = cute.make_tensor(red_ptrs[w], cute.make_layout((4, TILE_N), stride=(TILE_N, 1)))
        warp_w = wtid // 32
        steps = tuple(range(d // 16))
        k_out = mMass.shape[1]
        uses = cute.make_rmem_tensor((1,), Int32)  # this WG's blocks in earlier tiles
        uses[0] = Int32(0)
        for t in cutlass.range(bidx, n_tiles, n_ctas, unroll=1):
            ti = (t - bidx) // n_ctas
            s = t // (h // TILE_M)
            h0 = (t % (h // TILE_M)) * TILE_M
            n_blk = (self._len(mLen, s, k_slots) + TILE_N - 1) // TILE_N
            n_own = cutlass.max((n_blk - w + 1) // 2, 0)
            for r in cutlass.range_constexpr(2):
                lse2[r] = mLse[s, h0 + rows[r]] * LOG2E
            cute.arch.mbarrier_wait(q_full, ti % 2)
            for k in cutlass.range_constexpr(n_k):
                words = _ldmatrix_x4(q_smem + _swizzled_byte_offset(q_row, 16 * k + q_col, TILE_M))
                for i in cutlass.range_constexpr(4):
                    rQ_words[i, k] = words[i]
            cute.arch.mbarrier_arrive(q_empty)  # Q is in registers: the room is the producer's
            for it in cutlass.range(n_own, unroll=1):
                ph = (uses[0] + it) % 2
                cute.arch.mbarrier_wait(full_own + w, ph)
                cute.arch.mbarrier_wait(full_rest + w, ph)
                cute.arch.fence_view_async_shared()
                warpgroup.fence()
                self._mma(mma_s, acc_s, rQ, tSrK, steps, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                for c in cutlass.range_constexpr(n_cols):
                    i0 = (c // 2) * 4 + c % 2  # rows r0 and r0 + 8 of this column
                    p0 = _ex2(acc_s[i0] * scale_log2 - lse2[0])
                    p1 = _ex2(acc_s[i0 + 2] * scale_log2 - lse2[1])
                    v = p0 + p1
                    if sValid[w, cS[i0][1]] == 0:
                        v = Float32(0.0)
                    csum[c] = v
                # the stage (both parts, and its validity bytes) is the producer's again
                cute.arch.mbarrier_arrive(empty_own + w)
                cute.arch.mbarrier_arrive(empty_rest + w)
                for c in cutlass.range_constexpr(n_cols):
                    v = csum[c]
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=4)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=8)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=16)
                    csum[c] = v
                _barrier_sync(4 + w, 128)  # the previous block's sums have been read
                if lane < 4:
                    for c in cutlass.range_constexpr(n_cols):
                        sRed[warp_w, cS[(c // 2) * 4 + c % 2][1]] = csum[c]
                _barrier_sync(4 + w, 128)
                if wtid < TILE_N:
                    col = (w + 2 * it) * TILE_N + wtid
                    if col < k_out:
                        tot = sRed[0, wtid] + sRed[1, wtid] + sRed[2, wtid] + sRed[3, wtid]
                        mMass[t, col] = tot
            uses[0] = uses[0] + n_own

    @cute.jit
    def _store_out(self, mOut: cute.Tensor, t: Int32, ti: Int32, wtid: Int32, o_full, o_empty,
                   o_smem):
        """WG1 copies tile t's staged output (the CTA's tile number ti) from stage 1 to global
        memory: warp k takes row halves k, k + 4, ..., one 512-byte row half per instruction.
        The stores are not waited for; stage 1 is the producer's again once they have read it.

        WG1 does this once the next tile's Q has landed: loads and stores share the L2 that all
        SMs draw on, so the next tile's Q and block 0 go first, and WG1
        would wait for block 1 (which goes into stage 1) anyway."""
        h = self.h
        cute.arch.mbarrier_wait(o_full, ti % 2)
        s = t // (h // TILE_M)
        h0 = (t % (h // TILE_M)) * TILE_M
        lane = wtid % 32
        policy = _l2_policy("evict_first")
        out_row0 = mOut.iterator.toint() + (Int64(s) * h + h0) * (D_V * 2)
        for i in cutlass.range(2 * TILE_M // 4, unroll=8):
            rh = wtid // 32 + 4 * i  # row half: WG rh // 64's columns of row rh % 64
            g = out_row0 + ((rh % TILE_M) * D_V + (rh // TILE_M) * HALF) * 2
            _copy_16_to_global(g + lane * 16, (o_smem + rh * O_ROW).toint() + lane * 16, policy)
        cute.arch.mbarrier_arrive(o_empty)

    @cute.jit
    def _epilogue(self, st, ti: Int32, s: Int32, h0: Int32, sm_scale: Float32,
                  mSink: cute.Tensor, mLse: cute.Tensor, mMax: cute.Tensor, o_smem,
                  sSum: cute.Tensor, sTrue: cute.Tensor, thr_rs, o_full, o_empty):
        """Row sums across both WGs, lse / max_logits, and this WG's half of the output,
        staged in shared memory for WG1 to store (see _store_out)."""
        (w, o, d, acc_s, acc_o, rP, rP_words, tSrQ, tSrK, tOrV_own, tOrV_oth,
         sP_own, sP_oth, cS, rows, m_cur, m_true, l_sum, sMax, sValid, sAllValid, mma_s,
         mma_rs, lane, scale_log2, full_own, full_rest, empty_own, empty_rest, ready, uses,
         n_own, q_empty) = st
        par = ti % 2
        for r in cutlass.range_constexpr(2):
            l = l_sum[r]
            l = l + cute.arch.shuffle_sync_bfly(l, offset=1)
            l = l + cute.arch.shuffle_sync_bfly(l, offset=2)
            mt = m_true[r]  # this thread's; the quad's max here, once per tile
            mt = cute.arch.fmax(mt, cute.arch.shuffle_sync_bfly(mt, offset=1))
            mt = cute.arch.fmax(mt, cute.arch.shuffle_sync_bfly(mt, offset=2))
            if lane % 4 == 0:
                sSum[par, w, rows[r]] = l
                sTrue[par, w, rows[r]] = mt
        _barrier_sync(3, 256)
        factor = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            l = sSum[par, 0, rows[r]] + sSum[par, 1, rows[r]]  # same order in both WGs
            m = m_cur[r]
            lse = Float32(math.inf)
            mx = Float32(-math.inf)
            f = Float32(0.0)
            if l > 0.0:
                m_scaled = m * sm_scale
                lse = m_scaled + _lg2(l) * LN2
                mx = cute.arch.fmax(sTrue[par, 0, rows[r]], sTrue[par, 1, rows[r]]) * sm_scale
                sink = mSink[h0 + rows[r]]
                f = 1.0 / (l + _ex2((sink - m_scaled) * LOG2E))
            factor[r] = f
            if const_expr(w == 0):
                if lane % 4 == 0:
                    mLse[s, h0 + rows[r]] = lse
                    mMax[s, h0 + rows[r]] = mx
        rO = cute.make_rmem_tensor_like(acc_o, BFloat16)
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            rO[i] = (acc_o[i] * factor[(i // 2) % 2]).to(BFloat16)
        # O is staged in stage 1 (every block of the tile is done) once WG1 has copied the
        # previous tile's output out of it; WG1 stores this one when the next tile starts.
        if ti > 0:
            cute.arch.mbarrier_wait(o_empty, (ti - 1) % 2)
        sO = cute.make_tensor(o_smem + w * TILE_M * O_ROW,
                              cute.make_layout((TILE_M, HALF), stride=(O_ROW, 1)))
        cute.autovec_copy(rO, thr_rs.partition_C(sO))
        cute.arch.mbarrier_arrive(o_full)

    @cute.jit
    def _own_block(self, st, it: Int32, has_other: cutlass.Constexpr[bool]):
        """WG w's block n = w + 2 it: S (its own V half first, then the rest) with the other
        WG's block n - 1 slotted in between, then the softmax (publishing M and P of block n),
        then its own P V.

        The other WG's P V of block n - 1 is issued before the rest of S_n so that its wgmma
        group can be waited for first: the part of that block's stage it reads is released to
        the producer as soon as it is done, not after this block's softmax."""
        (w, o, d, acc_s, acc_o, rP, rP_words, tSrQ, tSrK, tOrV_own, tOrV_oth,
         sP_own, sP_oth, cS, rows, m_cur, m_true, l_sum, sMax, sValid, sAllValid, mma_s,
         mma_rs, lane, scale_log2, full_own, full_rest, empty_own, empty_rest, ready, uses,
         n_own, q_empty) = st
        n_s = cute.size(acc_s)
        steps_own, steps_rest = _s_k_steps(w, d)
        ph = (uses[w] + it) % 2
        warpgroup.wait_group(0)  # own P V of block n - 2 done: its V half (and rP) are free
        if it > 0:
            cute.arch.mbarrier_arrive(empty_own + w)
        # S_n = Q K_n^T
        cute.arch.mbarrier_wait(full_own + w, ph)
        cute.arch.fence_view_async_shared()
        warpgroup.fence()
        self._mma(mma_s, acc_s, tSrQ, tSrK, steps_own, True)
        if const_expr(has_other):
            self._other_block(st, (uses[o] + it - 1 + w) % 2)
        # What the softmax needs when the reference max stays (the usual case), computed here,
        # off the chain: m_cur is final once the other WG's block n - 1 is in. The max is
        # published now and overwritten below if it moves (the other WG reads it only after
        # part 0 of P is out).
        thr = cute.make_rmem_tensor((2,), Float32)
        m_use0 = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            thr[r] = m_cur[r] + 8.0 / scale_log2
            m_use0[r] = self._ref(m_cur[r]) * scale_log2
            if lane % 4 == 0:
                sMax[w, rows[r]] = m_cur[r]
        cute.arch.mbarrier_wait(full_rest + w, ph)
        cute.arch.fence_view_async_shared()
        warpgroup.fence()
        self._mma(mma_s, acc_s, tSrQ, tSrK, steps_rest, False)
        warpgroup.commit_group()
        if const_expr(has_other):
            warpgroup.wait_group(1)  # P V of block n - 1 done: release its part of the stage
            cute.arch.mbarrier_arrive(empty_rest + o)
        warpgroup.wait_group(0)
        if it == n_own - 1:
            cute.arch.mbarrier_arrive(q_empty)  # this WG's last S of the tile is done
        # mask invalid slots (skipped when the producer saw every slot valid), row max
        all_valid = (sAllValid[w, 0] & sAllValid[w, 1] & sAllValid[w, 2] & sAllValid[w, 3])
        if all_valid == 0:
            for i in cutlass.range_constexpr(n_s):
                if sValid[w, cS[i][1]] == 0:
                    acc_s[i] = Float32(-math.inf)
        m_loc = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            m_loc[r] = _tree_max([acc_s[i] for i in range(n_s) if (i // 2) % 2 == r])
            m_true[r] = cute.arch.fmax(m_true[r], m_loc[r])  # the quad's max at the epilogue
        m_use = cute.make_rmem_tensor((2,), Float32)
        scale_row = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            scale_row[r] = Float32(1.0)
            m_use[r] = m_use0[r]
        # Conditional rescaling (FlashAttention-4): keep the chain's reference max unless this
        # block's exceeds it by more than 2^8 in P, so O and l are rarely rescaled; P up to 2^8
        # is safe in fp32 and bf16. The row max (over the quad of threads that share a row) only
        # matters when it moves the reference max, so its shuffles are skipped when no thread
        # of the warp holds a logit past the threshold (the usual case after a row's first
        # blocks).
        if cute.arch.vote_any_sync(m_loc[0] > thr[0] or m_loc[1] > thr[1]):
            for r in cutlass.range_constexpr(2):
                m = m_loc[r]
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
                m_new = m_cur[r]
                if (m - m_cur[r]) * scale_log2 > 8.0:
                    m_new = m
                if lane % 4 == 0:
                    sMax[w, rows[r]] = m_new
                scale_row[r], m_use[r] = self._rebase(m_cur[r], m_new, scale_log2)
                m_cur[r] = m_new
        psum = cute.make_rmem_tensor((2,), Float32)
        psum.fill(0.0)
        part = n_s // P_PARTS  # accumulator elements (and P elements) per part
        for j in cutlass.range_constexpr(P_PARTS):
            for i in cutlass.range_constexpr(j * part, (j + 1) * part):
                p = _ex2(acc_s[i] * scale_log2 - m_use[(i // 2) % 2])
                acc_s[i] = p
                psum[(i // 2) % 2] = psum[(i // 2) % 2] + p
            # elements 8k..8k+7 of the fragment are k step k of P (see rP)
            p_f32 = cute.make_tensor(acc_s.iterator + j * part, cute.make_layout(part))
            p_bf16 = cute.make_tensor(rP.iterator + j * part, cute.make_layout(part))
            p_bf16.store(p_f32.load().to(BFloat16))
            cute.autovec_copy(self._p_words(rP_words, j), self._p_words(sP_own, j))
            cute.arch.mbarrier_arrive(ready + w + 2 * j)  # part j of block n published (release)
            if const_expr(j == 0):
                self._rescale(acc_o, scale_row)
            warpgroup.fence()
            self._mma(mma_rs, acc_o, rP, tOrV_own, self._p_k_steps(j), False)
        warpgroup.commit_group()
        for r in cutlass.range_constexpr(2):
            l_sum[r] = l_sum[r] * scale_row[r] + psum[r]

    @staticmethod
    def _p_k_steps(j: int):
        """k steps of the P V product that part j of P feeds."""
        return _PV_K_STEPS[j * _STEPS_PER_PART:(j + 1) * _STEPS_PER_PART]

    @staticmethod
    def _p_words(t: cute.Tensor, j: int):
        """Part j of a thread's P words (a (4, 4) view, one column of 4 words per k step)."""
        return cute.make_tensor(t.iterator + j * _STEPS_PER_PART * t.layout.stride[1],
                                cute.make_layout((4, _STEPS_PER_PART), stride=t.layout.stride))

    @cute.jit
    def _ref(self, m: Float32) -> Float32:
        """What a row's P is taken relative to: its reference max, or 0 while that is -inf (no
        valid slot yet), so that P is 0, not NaN."""
        mu = m
        if m == -math.inf:
            mu = Float32(0.0)
        return mu

    @cute.jit
    def _rebase(self, m_old: Float32, m_new: Float32, scale_log2: Float32):
        """Moving a row's reference max from m_old to m_new: the factor for its O and l, and the
        exp2 offset of its P. The factor is 1 without an exp2 when the max stayed (also while it
        is -inf: O and l are still 0 then)."""
        mu = self._ref(m_new)
        scale = Float32(1.0)
        if m_new != m_old:
            scale = _ex2((m_old - mu) * scale_log2)
        return scale, mu * scale_log2

    @cute.jit
    def _rescale(self, acc_o: cute.Tensor, scale_row: cute.Tensor):
        """O rows *= their factor, skipped for the (usual) factor 1."""
        for r in cutlass.range_constexpr(2):
            if scale_row[r] != 1.0:
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    if const_expr((i // 2) % 2 == r):
                        acc_o[i] = acc_o[i] * scale_row[r]

    @cute.jit
    def _other_block(self, st, phase: Int32):
        """Wait for the other WG's next block part by part, load each part of its P, rebase O to
        its published max (with part 0) and issue each part's P V on this WG's output columns
        (one wgmma group, with whatever this WG issued before it)."""
        (w, o, d, acc_s, acc_o, rP, rP_words, tSrQ, tSrK, tOrV_own, tOrV_oth,
         sP_own, sP_oth, cS, rows, m_cur, m_true, l_sum, sMax, sValid, sAllValid, mma_s,
         mma_rs, lane, scale_log2, full_own, full_rest, empty_own, empty_rest, ready, uses,
         n_own, q_empty) = st
        for j in cutlass.range_constexpr(P_PARTS):
            cute.arch.mbarrier_wait(ready + o + 2 * j, phase)  # acquire: its M and P part j
            cute.autovec_copy(self._p_words(sP_oth, j), self._p_words(rP_words, j))
            if const_expr(j == 0):
                scale_row = cute.make_rmem_tensor((2,), Float32)
                for r in cutlass.range_constexpr(2):
                    m_new = sMax[o, rows[r]]
                    # the usual case (the max stayed) skips the exp2, which is on the chain here
                    scale_row[r], _ = self._rebase(m_cur[r], m_new, scale_log2)
                    m_cur[r] = m_new
                    l_sum[r] = l_sum[r] * scale_row[r]
                self._rescale(acc_o, scale_row)
            warpgroup.fence()
            self._mma(mma_rs, acc_o, rP, tOrV_oth, self._p_k_steps(j), False)
        warpgroup.commit_group()
