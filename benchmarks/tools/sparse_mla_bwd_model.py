"""Roofline estimates of four sparse-MLA backward designs on one H200 (issue 48,
benchmarks/notes/sparse_mla_bwd.md), with the adjacent-query overlap measured by
``benchmarks/tools/topk_overlap.py`` plugged in. Arithmetic only: no GPU, nothing timed.

Shapes: GLM-5 (H 64, D_qk 576, D_v 512, top-k 2048); S 16384 all slots valid (the kernel
benchmarks' shape) and S 131072 causal. Rates (H200): tensor 670 TFLOP/s (a bf16 matmul's
sustained rate) and 0.8 of it for a fused backward; fp32 L2 reductions as measured in the
shared research notes (research/sparse_mla_backward.md §2: red.v4 / bulk reduce into 2304-byte
rows, alone and with the kv gathers running); HBM streams of 2304-byte rows 4.4 TB/s (ld.cg /
st.cg measured 4.3-4.6); the forward's own rates for the dq kernel of design (iii) (603 TFLOP/s
at 16K, 509 at 128K, benchmarks/notes/sparse_mla_fwd.md).

    .venv/bin/python benchmarks/tools/sparse_mla_bwd_model.py [--overlap FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
H, DQK, DV, K = 64, 576, 512, 2048
FLOP_PAIR = H * 2 * (3 * DQK + 2 * DV)  # S, dP, dV, dK, dQ GEMMs per (query, slot): 352,256
FLOP_PAIR_CONV = 10 * H * DQK  # the project's TFLOP/s convention (10 S K H D_qk)
RED_PAIR = DQK * 4  # fp32 dKV row
KV_PAIR = DQK * 2  # bf16 kv row gathered
QDO = H * (DQK + DV) * 2  # one query's Q + dO, bf16 (139,264 bytes)
TC, TC_REAL = 670e12, 0.8 * 670e12
HBM = 4.4e12
# fp32 reduction rates (TB/s): (with the gathers, alone); an int64 buffer is twice as large, so
# it gets the rates of twice the rows (16K -> the 32K row; 128K: assumed no worse: unmeasured).
RED = {16384: (2.83e12, 3.76e12), 131072: (1.33e12, 1.52e12)}
RED64 = {16384: (1.75e12, 2.19e12), 131072: (1.33e12, 1.52e12)}
FWD = {16384: 603e12, 131072: 509e12}
CHUNK = 2048  # queries per partial-buffer chunk in design (ii)


def pairs(s, causal):
    return s * K - (K * K // 2 if causal else 0)


def uniform_visits(s):
    """Expected (query, 64-key block) visits of uniform causal top-k lists."""
    total = 0.0
    for t in range(1, s + 1):
        if t <= K:
            total += -(-t // 64)
        else:
            total += (t / 64) * (1 - (1 - 64 / t) ** K)
    return total


def estimate(s, causal, r2, visits):
    p = pairs(s, causal)
    t_tc = (p * FLOP_PAIR / TC, p * FLOP_PAIR / TC_REAL)
    red = p * RED_PAIR
    out = {"pairs_M": round(p / 1e6, 1), "tflop_real": round(p * FLOP_PAIR / 1e12, 2),
           "tflop_conv": round(p * FLOP_PAIR_CONV / 1e12, 2),
           "gather_GB": round(p * KV_PAIR / 1e9, 1), "reduce_GB": round(red / 1e9, 1),
           "tensor_ms": [round(1e3 * x, 1) for x in t_tc]}
    ms = lambda lo, hi: [round(1e3 * lo, 1), round(1e3 * hi, 1)]
    # (i) query-major, fp32 atomics into dKV; r2: pair sharing (shared rows once per pair)
    for name, r in (("i_atomics", 1.0), ("i_atomics_pairs", r2)):
        lo = max(t_tc[0], r * red / RED[s][1])
        hi = max(t_tc[1], r * red / RED[s][0])
        out[name] = ms(lo, hi)
    # (ii) partial dKV rows per (query, slot) streamed to HBM, CSR (stable radix sort by row,
    # 3 passes of 8-byte key/value pairs) and a segmented reduction in (query, slot) order
    csr = 3 * p * 16 / HBM
    for name, row in (("ii_fp32", RED_PAIR), ("ii_bf16", KV_PAIR)):
        w = p * row
        acc = (s // CHUNK) * 2 * s * RED_PAIR  # per chunk: read + write the fp32 accumulator
        main = (max(t_tc[0], w / HBM), max(t_tc[1], w / HBM))
        red_t = (w + acc) / HBM
        seq = (main[0] + red_t + csr, main[1] + red_t + csr)
        over = (max(t_tc[0], (2 * w + acc) / HBM + csr), max(t_tc[1], (2 * w + acc) / HBM + csr))
        out[name] = {"sequential": ms(*seq), "chunks_overlapped": ms(*over),
                     "workspace_GB_per_chunk": round(CHUNK * K * row / 1e9, 1)}
    # (iii) kv-range-major: dq query-major (S, dP, dS, dQ: 3328 of 5504 FLOP), dKV per 64-key
    # block over the queries that select a key in it (masked 64 x 64 tiles, Q + dO per visit)
    b1 = p * H * 2 * (2 * DQK + DV + DQK) / FWD[s]
    f2 = visits * 64 * H * 2 * (DQK + DV + DV + DQK)
    b2 = (max(f2 / TC, visits * QDO / 10e12), max(f2 / TC_REAL, visits * QDO / HBM))
    out["iii_kv_major"] = {"visits_M": round(visits / 1e6, 1),
                           "flop_waste": round(f2 / (p * H * 2 * (2 * DQK + 2 * DV)), 2),
                           "qdo_TB": round(visits * QDO / 1e12, 2),
                           "ms": ms(b1 + b2[0], b1 + b2[1])}
    # (iv) int64 fixed-point reductions: twice the bytes, into a buffer twice as large
    for name, r in (("iv_int64", 1.0), ("iv_int64_pairs", r2)):
        lo = max(t_tc[0], 2 * r * red / RED64[s][1])
        hi = max(t_tc[1], 2 * r * red / RED64[s][0])
        out[name] = ms(lo, hi)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--overlap", default=str(ROOT / "benchmarks/results/topk_overlap_cpu.json"))
    args = p.parse_args(argv)
    runs = json.loads(pathlib.Path(args.overlap).read_text())["runs"]

    def measured(source, s, k):
        for r in runs:
            if (r["source"], r["seq_len"], r["topk"]) == (source, s, k):
                return r["mean_over_layers"]
        raise SystemExit(f"no {source} run at S {s} top-k {k} in {args.overlap}")

    # 16K: the measured S 16384 / top-k 2048 lists (causal; uniform: the benchmarks' non-causal
    # lists, analytic). 128K: top-k / S = 1/64, measured at
    # S 16384 / top-k 256 (the ratio of top-k 2048 at 128K).
    cases = {"16K": (16384, False, 16384, 2048), "128K causal": (131072, True, 16384, 256)}
    result = {}
    for label, (s, causal, ms_, mk) in cases.items():
        for source in ("uniform", "trained"):
            m = measured(source, ms_, mk)
            r2 = m["load_ratio"]["2"]
            if s == ms_ and source == "uniform" and not causal:
                # the benchmarks' lists: uniform over all S rows (not causal): analytic
                r2 = round(1 - K / (2 * s), 4)
                visits = s * (s / 64) * (1 - (1 - 64 / s) ** K)
            elif s == ms_:
                visits = m["blocks64_per_query"] * (s - m["first_full_query"]) + sum(
                    -(-(t + 1) // 64) for t in range(int(m["first_full_query"])))
            else:  # scale the uniform causal count by the measured blocks-per-query ratio
                u = measured("uniform", ms_, mk)["blocks64_per_query"]
                visits = uniform_visits(s) * m["blocks64_per_query"] / u
            est = estimate(s, causal, r2, visits)
            est["r2_used"] = r2
            result[f"{label} {source}"] = est
            print(f"== {label}, overlap and spread of the {source} lists "
                  f"(measured at S {ms_}, top-k {mk}): r(2) = {r2}")
            for k_, v in est.items():
                print(f"   {k_}: {v}")
    return result


if __name__ == "__main__":
    main()
