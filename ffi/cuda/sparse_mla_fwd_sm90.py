"""SM90 sparse MLA prefill forward (FlashMLA v2 contract), written with CuTe DSL.

Build-time module: ``export_sparse_mla_fwd.py`` compiles :class:`SparseMlaFwdSm90` ahead of time
for ``sm_90a`` and exports it as a C object; nothing here runs at run time.

Contract (one launch, flat tokens):
  q ``[S_q, H, D_qk]`` bf16 (H a multiple of 64), kv ``[S_kv, D_qk]`` bf16 (V = first 512
  columns), indices ``[S_q, K]`` int32, topk_length ``[S_q]`` int32 (slots at or past it are
  ignored), attn_sink ``[H]`` float32 (-inf = none), sm_scale.
  out ``[S_q, H, 512]`` bf16 = softmax-weighted V rows, scaled by exp(lse)/(exp(lse)+exp(sink));
  lse ``[S_q, H]`` float32 = natural-log logsumexp of sm_scale * q.k over valid slots (sink-free);
  max_logits ``[S_q, H]`` float32 = sm_scale * max q.k. A slot is valid iff its position is below
  topk_length and 0 <= index < S_kv; invalid slots are never read (their shared-memory rows are
  zero-filled). Rows with no valid slot: out 0, lse +inf, max_logits -inf.

Schedule (the FlashMLA SM90 idea, our own code): one CTA per (query token, 64-head tile).
Three warpgroups: WG0 gathers kv rows by index into shared memory with 16-byte cp.async
(zero-fill for invalid slots) into a two-stage ring guarded by mbarriers (cp.async arrivals), so
the next block's gather overlaps this block's math. WG1 and WG2 share each 64-row block: each
computes S = Q K^T for 32 of its rows with wgmma (M = 64 heads), the row max is merged through
shared memory, P (bf16) goes to shared memory, and each computes O[:, 256 w : 256 w + 256] += P V
with wgmma (N = 256), so a warpgroup holds a 64 x 256 fp32 accumulator.
Math: online softmax in base 2 with the max kept in raw logits (Milakov & Gimelshein 2018;
FlashAttention-2, Dao 2023).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Boolean, Float32, Int32, Int64, const_expr
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
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dsl_user_op
def _cp_async_16(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32, *, loc=None, ip=None):
    """16-byte cp.async (L2 only); src_bytes 0 writes zeros without reading global memory."""
    llvm.inline_asm(
        None,
        [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip),
         Int32(src_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


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


def _smem_layout(shape):
    """Row-major (K-major) bf16 tile in the 128-byte-swizzled layout wgmma reads."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, shape[1]), BFloat16)
    return cute.tile_to_shape(atom, shape, order=(0, 1))


def _transpose(t):
    """(a, b) smem tensor viewed as (b, a)."""
    return cute.composition(t, cute.make_ordered_layout((t.shape[1], t.shape[0]), order=(1, 0)))


def _swizzled_byte_offset(row, col, d):
    """Byte offset of element (row, col) of a [64, d] tile in _smem_layout (SW128, K-major,
    8-row x 64-column atoms tiled down the rows first): plain offset row*64 + col%64 +
    (col/64)*4096 elements, then the 128-byte swizzle (bits 4-6 ^= bits 7-9)."""
    off = (row * 64 + (col % 64) + (col // 64) * (TILE_N * 64)) * 2
    return off ^ ((off >> 3) & 0x70)


class SparseMlaFwdSm90:
    def __init__(self, heads: int, d_qk: int):
        assert heads % TILE_M == 0 and d_qk in (512, 576)
        self.h = heads
        self.d = d_qk
        self.num_threads = 384
        self.producer_regs = 40
        self.consumer_regs = 232

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
                 mSink: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mMax: cute.Tensor,
                 sm_scale: Float32, stream: cuda.CUstream):
        d = self.d
        mma_s = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
            atom_layout_mnk=(1, 2, 1), tiler_mn=(TILE_M, TILE_N // 2))
        mma_o = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            atom_layout_mnk=(1, 2, 1), tiler_mn=(TILE_M, D_V // 2))
        sQ_layout = _smem_layout((TILE_M, d))
        sK_layout = _smem_layout((TILE_N, d))
        sV_layout = _smem_layout((TILE_N, D_V))
        sP_layout = _smem_layout((TILE_M, TILE_N))

        @cute.struct
        class Storage:
            full: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, STAGES]
            q_full: cute.struct.MemRange[cutlass.Int64, 1]
            row_max: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 2 * TILE_M], 16]
            row_sum: cute.struct.Align[cute.struct.MemRange[Float32, 2 * TILE_M], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE_M * d], 1024]
            sKV0: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE_N * d], 1024]
            sKV1: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE_N * d], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, TILE_M * TILE_N], 1024]

        self.storage_cls = Storage
        grid = (mQ.shape[0] * (self.h // TILE_M), 1, 1)
        self.kernel(mQ, mKV, mIdx, mLen, mSink, mOut, mLse, mMax, sm_scale, mma_s, mma_o,
                    sQ_layout, sK_layout, sV_layout, sP_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=Storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1)

    @cute.jit
    def _gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
              zero_init: cutlass.Constexpr[bool]):
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor, mLen: cute.Tensor,
               mSink: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mMax: cute.Tensor,
               sm_scale: Float32, mma_s: cute.TiledMma, mma_o: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout):
        d = self.d
        h = self.h
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        s = bidx // (h // TILE_M)
        h0 = (bidx % (h // TILE_M)) * TILE_M
        s_kv = mKV.shape[0]
        k_slots = mIdx.shape[1]
        n_len = cutlass.min(mLen[s], k_slots)
        n_len = cutlass.max(n_len, 0)
        n_blk = (n_len + TILE_N - 1) // TILE_N

        smem = SmemAllocator()
        st = smem.allocate(self.storage_cls)
        full = st.full.data_ptr()
        empty = st.empty.data_ptr()
        q_full = st.q_full.data_ptr()
        if tidx == 0:
            for i in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(full + i, 128)
                cute.arch.mbarrier_init(empty + i, 256)
            cute.arch.mbarrier_init(q_full, 128)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = [st.sKV0.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
              st.sKV1.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)]
        sV = [st.sKV0.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
              st.sKV1.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)]
        sP = st.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)

        if warp < 4:
            # ---------------- producer: gather kv rows by index ----------------
            cute.arch.setmaxregister_decrease(self.producer_regs)
            r_in = tidx // 8  # 16 rows per pass
            c_in = tidx % 8  # 8 x 16 B = 128 contiguous bytes of a row per pass
            q_smem = st.sQ.data_ptr().toint()
            kv_smem = st.sKV0.data_ptr().toint()
            kv_stage_bytes = Int32(TILE_N * d * 2)
            q_row0 = mQ.iterator.toint() + (Int64(s) * h + h0) * (d * 2)
            kv_base = mKV.iterator.toint()
            for i in cutlass.range_constexpr(TILE_M // 16):
                row = r_in + 16 * i
                for j in cutlass.range_constexpr(d // 64):
                    col = (c_in + 8 * j) * 8
                    _cp_async_16(q_smem + _swizzled_byte_offset(row, col, d),
                                 q_row0 + Int64(row * d + col) * 2, Int32(16))
            cute.arch.cp_async_mbarrier_arrive_noinc(q_full)
            idx_row = mIdx.iterator.toint() + Int64(s) * Int64(k_slots) * 4
            for blk in cutlass.range(n_blk, unroll=1):
                stage = blk % STAGES
                if blk >= STAGES:
                    cute.arch.mbarrier_wait(empty + stage, ((blk // STAGES) - 1) % 2)
                stage_smem = kv_smem + stage * kv_stage_bytes
                for i in cutlass.range_constexpr(TILE_N // 16):
                    row = r_in + 16 * i
                    pos = blk * TILE_N + row
                    kv_row = Int32(-1)
                    if pos < n_len:
                        kv_row = mIdx[s, pos]
                    ok = kv_row >= 0 and kv_row < s_kv
                    nbytes = Int32(0)
                    src = kv_base
                    if ok:
                        nbytes = Int32(16)
                        src = kv_base + Int64(kv_row) * (d * 2)
                    for j in cutlass.range_constexpr(d // 64):
                        col = (c_in + 8 * j) * 8
                        _cp_async_16(stage_smem + _swizzled_byte_offset(row, col, d),
                                     src + col * 2, nbytes)
                cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
        else:
            # ---------------- consumers: two warpgroups ----------------
            cute.arch.setmaxregister_increase(self.consumer_regs)
            ctid = tidx - 128
            wg = ctid // 128
            lane = tidx % 32
            scale_log2 = sm_scale * LOG2E

            thr_s = mma_s.get_slice(ctid)
            thr_o = mma_o.get_slice(ctid)
            tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
            tSrK = [thr_s.make_fragment_B(thr_s.partition_B(sK[0])),
                    thr_s.make_fragment_B(thr_s.partition_B(sK[1]))]
            tOrP = thr_o.make_fragment_A(thr_o.partition_A(sP))
            tOrV = [thr_o.make_fragment_B(thr_o.partition_B(_transpose(sV[0]))),
                    thr_o.make_fragment_B(thr_o.partition_B(_transpose(sV[1])))]
            tPsP = thr_s.partition_C(sP)
            cS = thr_s.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))

            acc_o = cute.make_rmem_tensor(thr_o.partition_shape_C((TILE_M, D_V)), Float32)
            acc_o.fill(0.0)
            acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((TILE_M, TILE_N)), Float32)
            n_s = cute.size(acc_s)
            n_o = cute.size(acc_o)
            # Accumulator element i of a wgmma fragment holds row r0 + 8 * ((i // 2) % 2).
            row_max = cute.make_rmem_tensor((2,), Float32)
            row_sum = cute.make_rmem_tensor((2,), Float32)
            row_max.fill(-math.inf)
            row_sum.fill(0.0)
            rows = cute.make_rmem_tensor((2,), Int32)
            rows[0] = cS[0][0]
            rows[1] = cS[2][0]
            sMax = cute.make_tensor(st.row_max.data_ptr(), cute.make_layout((2, 2, TILE_M)))
            sSum = cute.make_tensor(st.row_sum.data_ptr(), cute.make_layout((2, TILE_M)))
            valid = cute.make_rmem_tensor((n_s,), Boolean)

            cute.arch.mbarrier_wait(q_full, 0)
            n_pair = (n_blk + 1) // 2
            for bp in cutlass.range(n_pair, unroll=1):
                for stage in cutlass.range_constexpr(STAGES):
                    blk = bp * STAGES + stage
                    if blk < n_blk:
                        # slot validity of this thread's columns (reads overlap the gather)
                        # element i is column 2 * (i // 4) + i % 2 (+ the thread's base) and
                        # row half (i // 2) % 2: elements i and i + 2 share a column
                        for i in cutlass.range_constexpr(n_s):
                            if const_expr((i // 2) % 2 == 0):
                                pos = blk * TILE_N + cS[i][1]
                                kv_row = Int32(-1)
                                if pos < n_len:
                                    kv_row = mIdx[s, pos]
                                valid[i] = kv_row >= 0 and kv_row < s_kv
                            else:
                                valid[i] = valid[i - 2]
                        cute.arch.mbarrier_wait(full + stage, bp % 2)
                        cute.arch.fence_view_async_shared()
                        self._gemm(mma_s, acc_s, tSrQ, tSrK[stage], True)
                        warpgroup.wait_group(0)
                        # block row max over both warpgroups
                        m_loc = cute.make_rmem_tensor((2,), Float32)
                        m_loc.fill(-math.inf)
                        for i in cutlass.range_constexpr(n_s):
                            v = acc_s[i] if valid[i] else Float32(-math.inf)
                            acc_s[i] = v
                            m_loc[(i // 2) % 2] = cute.arch.fmax(m_loc[(i // 2) % 2], v)
                        for r in cutlass.range_constexpr(2):
                            m = m_loc[r]
                            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
                            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
                            m_loc[r] = m
                            if lane % 4 == 0:
                                sMax[blk % 2, wg, rows[r]] = m
                        cute.arch.barrier(barrier_id=1, number_of_threads=256)
                        scale_row = cute.make_rmem_tensor((2,), Float32)
                        m_use = cute.make_rmem_tensor((2,), Float32)
                        for r in cutlass.range_constexpr(2):
                            m_new = cute.arch.fmax(row_max[r], cute.arch.fmax(
                                m_loc[r], sMax[blk % 2, 1 - wg, rows[r]]))
                            mu = m_new
                            if m_new == -math.inf:
                                mu = Float32(0.0)
                            scale_row[r] = _ex2((row_max[r] - mu) * scale_log2)
                            m_use[r] = mu * scale_log2
                            row_max[r] = m_new
                        psum = cute.make_rmem_tensor((2,), Float32)
                        psum.fill(0.0)
                        for i in cutlass.range_constexpr(n_s):
                            p = _ex2(acc_s[i] * scale_log2 - m_use[(i // 2) % 2])
                            acc_s[i] = p
                            psum[(i // 2) % 2] = psum[(i // 2) % 2] + p
                        for r in cutlass.range_constexpr(2):
                            row_sum[r] = row_sum[r] * scale_row[r] + psum[r]
                        for i in cutlass.range_constexpr(n_o):
                            acc_o[i] = acc_o[i] * scale_row[(i // 2) % 2]
                        rP = cute.make_rmem_tensor_like(acc_s, BFloat16)
                        rP.store(acc_s.load().to(BFloat16))
                        cute.autovec_copy(rP, tPsP)
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier(barrier_id=2, number_of_threads=256)
                        self._gemm(mma_o, acc_o, tOrP, tOrV[stage], False)
                        warpgroup.wait_group(0)
                        cute.arch.mbarrier_arrive(empty + stage)

            # ---------------- epilogue ----------------
            for r in cutlass.range_constexpr(2):
                l = row_sum[r]
                l = l + cute.arch.shuffle_sync_bfly(l, offset=1)
                l = l + cute.arch.shuffle_sync_bfly(l, offset=2)
                row_sum[r] = l
                if lane % 4 == 0:
                    sSum[wg, rows[r]] = l
            cute.arch.barrier(barrier_id=3, number_of_threads=256)
            factor = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                l = row_sum[r] + sSum[1 - wg, rows[r]]
                m = row_max[r]
                lse = Float32(math.inf)
                mx = Float32(-math.inf)
                f = Float32(0.0)
                if l > 0.0:
                    m_scaled = m * sm_scale
                    lse = m_scaled + _lg2(l) * LN2
                    mx = m_scaled
                    sink = mSink[h0 + rows[r]]
                    f = 1.0 / (l + _ex2((sink - m_scaled) * LOG2E))
                factor[r] = f
                if wg == 0 and lane % 4 == 0:
                    mLse[s, h0 + rows[r]] = lse
                    mMax[s, h0 + rows[r]] = mx
            rO = cute.make_rmem_tensor_like(acc_o, BFloat16)
            for i in cutlass.range_constexpr(n_o):
                rO[i] = (acc_o[i] * factor[(i // 2) % 2]).to(BFloat16)
            gO = cute.make_tensor(mOut.iterator + (Int64(s) * h + h0) * D_V,
                                  cute.make_layout((TILE_M, D_V), stride=(D_V, 1)))
            cute.autovec_copy(rO, thr_o.partition_C(gO))
