"""GPU correctness of indexer_topk(implementation="cuda") (SM90) against a float64 NumPy oracle of
the scores and against implementation="xla". Run on an H100/H200 with jax_dsa._cuda_indexer
built:

    python benchmarks/gpu_check_indexer_topk.py [--out results.json] [--quick]

Every case draws fresh random inputs (bfloat16-representable q, k unless said otherwise) and
checks, per row:

* validity: ``min(topk, visible)`` distinct visible keys first, ``-1`` after;
* against the oracle ``I = sum_h w relu(q_h . k)`` in float64: no unselected visible key beats a
  selected one by more than the two keys' error bounds, and the output is in descending oracle
  order up to the bounds. The bound of one score is ``tol = 4e-5 * sum_h |w_h| sum_d |q_hd k_d|``:
  the tensor cores' float32 accumulation over D = 128 products (each exact for bf16 inputs),
  taken as 128 * 2^-22 relative to sum |q k| to allow for their truncating alignment, plus the
  float32 weighting and the sum over <= 64 heads (64 * 2^-23); for float32 q, k the rounding of
  both to bf16 adds 2^-8 * sum_h |w_h| sum_d |q_hd k_d|;
* the kernel's own float32 scores (the workspace, single-chunk cases): within the bound of the
  oracle, -inf exactly on invisible keys, and the selection exact on them: descending score,
  equal scores by ascending index, nothing unselected above the threshold, and at the threshold
  only higher indices left out (the tie rule);
* against "xla": the same set on every row whose oracle gap between the topk-th and the next key
  exceeds the bounds; exact equality of the whole row where the scores tie structurally (zero
  keys, duplicated keys, ReLU plateaus);
* determinism: a second run gives the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_dsa
from jax_dsa.ops.indexer.topk import cuda as tc


def _ensure_registered():
    """Until jax_dsa/ops/indexer/topk.py registers topk_cuda, add it here (scripts only)."""
    from jax_dsa.ops.indexer.topk import op as topk_op
    from jax_dsa.ops.indexer.topk import cuda as topk_cuda
    from jax_dsa.ops.registry import Registry

    if "cuda" not in topk_op.REGISTRY:
        print("note: registering topk_cuda in indexer_topk's registry (not yet in topk.py)")
        topk_op.REGISTRY = Registry(
            "indexer_topk", (topk_op.topk_xla.IMPLEMENTATION, topk_cuda.IMPLEMENTATION),
            preference={"default": ("xla",), "gpu": ("cuda", "xla")})


_ensure_registered()

BF = ml_dtypes.bfloat16
TOL = 4e-5
POISON = 0x7F7F7F7F
FAKE = False  # --fake-with-xla: test this script on any machine with "xla" in place of "cuda"


def bf(x):
    return np.asarray(x, np.float32).astype(BF).astype(np.float32)


def oracle(q, k, w, rows, f32_inputs=False):
    """float64 scores and error bounds for rows ``rows`` of one batch element."""
    qq = q[rows].astype(np.float64)  # [R, H, D]
    kk = k.astype(np.float64)
    ww = w[rows].astype(np.float64)
    out = np.empty((len(rows), k.shape[0]))
    bound = np.empty_like(out)
    step = max(1, int(2e8 // (qq.shape[1] * k.shape[0] * 8)))
    for i in range(0, len(rows), step):
        dots = np.einsum("rhd,sd->rhs", qq[i:i + step], kk, optimize=True)
        out[i:i + step] = np.einsum("rhs,rh->rs", np.maximum(dots, 0), ww[i:i + step])
        a = np.einsum("rh,rhd->rd", np.abs(ww[i:i + step]), np.abs(qq[i:i + step]))
        bound[i:i + step] = a @ np.abs(kk).T
    c = TOL + (2.0 ** -8 if f32_inputs else 0.0)
    return out, bound * c + 1e-30


def poison_allocator(shape):
    """Best effort: fill a freed block of the output's size with a pattern the kernel would leave
    behind if it skipped elements (XLA's allocator reuses freed blocks)."""
    x = jnp.full(shape, POISON, jnp.int32)
    x.block_until_ready()
    del x


class Report:
    def __init__(self):
        self.cases = []
        self.failed = 0

    def add(self, name, ok, **info):
        self.cases.append(dict(name=name, ok=bool(ok), **info))
        self.failed += not ok
        flag = "ok  " if ok else "FAIL"
        print(f"[{flag}] {name}: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)


def run_case(rep, name, rng, nb, s_q, s_kv, h, topk, *, q_pos=None, kv_pos=None, seg=None,
             ties=None, f32=False, rows_checked=None, ws_check=True, xla=True, chunk_limit=None):
    t_case = time.perf_counter()
    d = 128
    q = rng.standard_normal((nb, s_q, h, d)).astype(np.float32) * 0.5
    k = rng.standard_normal((nb, s_kv, d)).astype(np.float32)
    w = (rng.standard_normal((nb, s_q, h)) * (h ** -0.5) * (d ** -0.5)).astype(np.float32)
    if ties == "zeros":  # zero keys, duplicated keys, and rows whose q never passes the ReLU
        zero = rng.random((nb, s_kv)) < 0.3
        k[zero] = 0
        dup = rng.random((nb, s_kv)) < 0.2
        src = rng.integers(0, s_kv, (nb, s_kv))
        for b in range(nb):
            k[b, dup[b]] = k[b, src[b, dup[b]]]
        k = np.abs(k)
        neg = rng.random((nb, s_q)) < 0.3
        q[neg] = -np.abs(q[neg])  # every dot product <= 0 -> score exactly 0
        w = np.abs(w)
    if not f32:
        q, k = bf(q), bf(k)
    if q_pos is None:
        q_pos = np.broadcast_to(np.arange(s_q) + (s_kv - s_q), (nb, s_q))
    if kv_pos is None:
        kv_pos = np.broadcast_to(np.arange(s_kv), (nb, s_kv))
    q_pos = np.asarray(q_pos, np.int32)
    kv_pos = np.asarray(kv_pos, np.int32)
    q_seg = kv_seg = None
    if seg is not None:
        q_seg, kv_seg = (np.asarray(x, np.int32) for x in seg)

    qj = jnp.asarray(q, jnp.bfloat16 if not f32 else jnp.float32)
    kj = jnp.asarray(k, jnp.bfloat16 if not f32 else jnp.float32)
    wj = jnp.asarray(w)

    def op(impl):
        return jax.jit(lambda q, k, w, qp, kp, qs, ks: jax_dsa.indexer_topk(
            q, k, w, topk=topk, q_positions=qp, kv_positions=kp, q_segment_ids=qs,
            kv_segment_ids=ks, implementation=impl))

    saved = tc.WORKSPACE_LIMIT
    if chunk_limit is not None:
        tc.WORKSPACE_LIMIT = chunk_limit
    try:
        args = (qj, kj, wj, q_pos, kv_pos, q_seg, kv_seg)
        poison_allocator((nb, s_q, topk))
        impl = "xla" if FAKE else "cuda"
        t0 = time.perf_counter()
        got = np.asarray(op(impl)(*args))
        t_cuda = time.perf_counter() - t0
        again = np.asarray(op(impl)(*args))
        ws = None
        if ws_check and nb == 1 and FAKE:  # the script's own test: float32 oracle scores
            I0, _ = oracle(q[0], k[0], w[0], np.arange(s_q))
            vis0 = kv_pos[0][None, :] <= q_pos[0][:, None]
            if q_seg is not None:
                vis0 &= kv_seg[0][None, :] == q_seg[0][:, None]
            ld = -(-s_kv // 64) * 64
            sc0 = np.full((s_q, ld), -np.inf, np.float32)
            sc0[:, :s_kv] = np.where(vis0, I0.astype(np.float32) + 0.0, -np.inf)
            ws = (sc0, np.tile(np.array([[0, ld]], np.int32), (s_q, 1)))
        elif ws_check and nb == 1:
            rows = tc.chunk_rows(s_q, s_kv)
            if rows >= s_q:
                _, ws, _ = jax.jit(lambda *a: tc.topk_call(*a, min(topk, s_kv)))(
                    qj, kj, wj, jnp.asarray(q_pos), jnp.asarray(kv_pos),
                    None if q_seg is None else jnp.asarray(q_seg),
                    None if kv_seg is None else jnp.asarray(kv_seg))
                ws = np.asarray(ws)
                ld = -(-s_kv // 64) * 64
                scores = ws[:rows * ld * 4].view(np.float32).reshape(rows, ld)
                off = -(-(rows * ld * 4) // 256) * 256
                ranges = ws[off:off + rows * 8].view(np.int32).reshape(rows, 2)
                ws = (scores, ranges)
    finally:
        tc.WORKSPACE_LIMIT = saved
    ref_x = np.asarray(op("xla")(*args)) if xla else None

    info = dict(shape=f"nb={nb} s_q={s_q} s_kv={s_kv} h={h} topk={topk}", first_call_s=round(t_cuda, 2))
    ok = True
    if got.shape != (nb, s_q, topk) or got.dtype != np.int32:
        rep.add(name, False, why=f"shape/dtype {got.shape} {got.dtype}")
        return
    if np.any(got == POISON):
        ok = False
        info["poison_left"] = int(np.sum(got == POISON))
    if not np.array_equal(got, again):
        ok = False
        info["nondeterministic_rows"] = int(np.sum(np.any(got != again, axis=-1)))
    bad_valid = bad_oracle = bad_order = bad_ws = bad_tie = bad_xla = 0
    xla_rows = xla_exact_rows = xla_eq = 0
    max_rel_err = 0.0
    first_bad = None
    for b in range(nb):
        rows = np.arange(s_q) if rows_checked is None else np.asarray(rows_checked)
        # float32 q, k: the oracle of the float32 inputs, the bound widened by their rounding.
        I, tol = oracle(q[b], k[b], w[b], rows, f32_inputs=f32)
        for ri, t in enumerate(rows):
            vis = kv_pos[b] <= q_pos[b, t]
            if q_seg is not None:
                vis &= kv_seg[b] == q_seg[b, t]
            nvis = int(vis.sum())
            kp = min(topk, nvis)
            sel = got[b, t]
            head, tail = sel[:kp], sel[kp:]
            if (np.any(tail != -1) or np.any(head < 0) or np.any(head >= s_kv)
                    or len(set(head.tolist())) != kp or not np.all(vis[np.clip(head, 0, s_kv - 1)])):
                bad_valid += 1
                first_bad = first_bad or (b, int(t), "valid", sel[:8].tolist(), nvis)
                continue
            if kp == 0:
                continue
            Ir, tr = I[ri], tol[ri]
            chosen = np.zeros(s_kv, bool)
            chosen[head] = True
            rest = vis & ~chosen
            lo_sel = np.min(Ir[head] + tr[head])
            if rest.any() and np.max(Ir[rest] - tr[rest]) > lo_sel:
                bad_oracle += 1
                first_bad = first_bad or (b, int(t), "oracle", float(np.max(Ir[rest] - tr[rest])), float(lo_sel))
            if np.any(Ir[head][:-1] + tr[head][:-1] < Ir[head][1:] - tr[head][1:]):
                bad_order += 1
            if ws is not None and b == 0:
                sc, rg = ws
                lo, hi = rg[t]
                srow = np.full(s_kv, -np.inf, np.float32)
                srow[lo:min(hi, s_kv)] = sc[t, lo:min(hi, s_kv)]
                finite = np.isfinite(srow)
                err = np.abs(srow[vis].astype(np.float64) - Ir[vis])
                if (np.any(finite != vis) or np.any(err > tr[vis])):
                    bad_ws += 1
                    first_bad = first_bad or (b, int(t), "scores", int(np.sum(finite != vis)), float(np.max(err / tr[vis], initial=0)))
                if vis.any():
                    scale = max(np.max(np.abs(Ir[vis])), 1e-30)
                    max_rel_err = max(max_rel_err, float(np.max(err) / scale))
                # Exact rule on the kernel's own scores.
                s_sel = srow[head]
                order_ok = np.all((s_sel[:-1] > s_sel[1:]) |
                                  ((s_sel[:-1] == s_sel[1:]) & (head[:-1] < head[1:])))
                thr = s_sel[-1]
                above = rest & (srow > thr)
                at = rest & (srow == thr)
                tie_ok = (not above.any()) and (not at.any() or
                                                np.min(np.nonzero(at)[0]) > np.max(head[s_sel == thr]))
                if not (order_ok and tie_ok):
                    bad_tie += 1
                    first_bad = first_bad or (b, int(t), "tie-rule", bool(order_ok), bool(tie_ok))
            if ref_x is not None:
                xs = ref_x[b, t]
                if np.array_equal(xs, sel):
                    xla_eq += 1
                srt = np.sort(Ir[vis])[::-1]
                if kp < nvis:
                    gap = srt[kp - 1] - srt[kp]
                    clear = gap > 2 * np.max(tr[vis]) + 1e-6 * abs(srt[kp - 1])
                else:
                    clear = True
                if clear:
                    xla_rows += 1
                    if set(xs[:kp].tolist()) != set(head.tolist()) or np.any(xs[kp:] != -1):
                        bad_xla += 1
                        first_bad = first_bad or (b, int(t), "xla-set")
                if ties == "zeros":
                    # The structural zeros: both pick the same lowest-index zero keys.
                    zc = [x for x in head if Ir[x] == 0]
                    zx = [x for x in xs[:kp] if x >= 0 and Ir[x] == 0]
                    xla_exact_rows += 1
                    if zc != zx:
                        bad_xla += 1
                        first_bad = first_bad or (b, int(t), "xla-zero-ties", zc[:5], zx[:5])
    ok = ok and not (bad_valid or bad_oracle or bad_ws or bad_tie or bad_xla)
    info.update(rows=len(rows) * nb, bad_valid=bad_valid, bad_oracle=bad_oracle,
                bad_order=bad_order, bad_scores=bad_ws, bad_tie_rule=bad_tie, bad_xla=bad_xla)
    if ref_x is not None:
        info.update(xla_clear_rows=xla_rows, xla_identical_rows=xla_eq)
    if ws is not None:
        info["max_score_rel_err"] = f"{max_rel_err:.2e}"
    if first_bad:
        info["first_bad"] = first_bad
    info["case_s"] = round(time.perf_counter() - t_case, 1)
    rep.add(name, ok, **info)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fake-with-xla", action="store_true")
    a = ap.parse_args()
    global FAKE
    FAKE = a.fake_with_xla
    print("devices:", jax.devices(), "cc:", getattr(jax.devices()[0], "compute_capability", None))
    print("cuda module:", tc.module_error() or "loaded", "(FAKE: checking xla)" if FAKE else "")
    rep = Report()
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    t0 = time.time()
    run_case(rep, "h32 causal", rng, 1, 1000, 1000, 32, 128)
    run_case(rep, "h20 (padded to 32), q rows after keys", rng, 1, 700, 900, 20, 100)
    run_case(rep, "h48 (padded to 64)", rng, 1, 600, 600, 48, 64)
    run_case(rep, "h64 V3.2 topk 2048", rng, 1, 2500, 2500, 64, 2048)
    run_case(rep, "batch 3, h32, topk 256", rng, 3, 300, 900, 32, 256)
    # S_kv < topk; rows that see nothing (keys start after the first queries).
    run_case(rep, "S_kv < topk, empty rows", rng, 2, 60, 40, 32, 2048,
             q_pos=np.broadcast_to(np.arange(60), (2, 60)),
             kv_pos=np.broadcast_to(np.arange(40) + 10, (2, 40)))
    # Packed documents with per-document positions.
    lens = [700, 1300, 1000]
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(lens)])[None]
    pos = np.concatenate([np.arange(n) for n in lens])[None]
    run_case(rep, "packed documents (segment ids)", rng, 1, 3000, 3000, 32, 512,
             q_pos=pos, kv_pos=pos, seg=(seg, seg))
    run_case(rep, "exact ties (zero/duplicate keys, ReLU zeros)", rng, 1, 1500, 1500, 32, 256,
             ties="zeros")
    run_case(rep, "exact ties, h64, topk 2048", rng, 1, 3000, 3000, 64, 2048, ties="zeros")
    # V4-like: compressed entries (ratio 4) at positions 4 i + 3 against token queries.
    run_case(rep, "V4-like compressed keys (kv_pos = 4 i + 3)", rng, 1, 4096, 1024, 64, 512,
             q_pos=np.arange(4096)[None], kv_pos=(4 * np.arange(1024) + 3)[None])
    run_case(rep, "several chunks", rng, 1, 1000, 2000, 32, 300, chunk_limit=1 << 20,
             ws_check=False)
    run_case(rep, "float32 q, k (rounded to bf16)", rng, 1, 800, 800, 32, 128, f32=True)
    rows = np.unique(np.concatenate([np.arange(0, 4096, 37), np.arange(4000, 4096)]))
    run_case(rep, "GLM-5 shape 4096 (rows sampled)", rng, 1, 4096, 4096, 32, 2048,
             rows_checked=rows)
    if not a.quick:
        run_case(rep, "S_kv 131072, 64 late rows (rows sampled)", rng, 1, 64, 131072, 32, 2048,
                 rows_checked=np.arange(0, 64, 4))
    print(f"checks took {time.time() - t0:.1f} s; {rep.failed} of {len(rep.cases)} cases failed")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(cases=rep.cases, failed=rep.failed), f, indent=1, default=str)
    sys.exit(1 if rep.failed else 0)


if __name__ == "__main__":
    main()
