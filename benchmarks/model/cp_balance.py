"""Work per context-parallel shard of causal DSA at S = 32K: contiguous shards against zigzag.

Work is counted per query token with :func:`jax_dsa.sharding.causal_work` (checked against
``visible_mask`` and against the valid slots ``indexer_topk`` returns, in
tests/test_sharding_zigzag.py):

* ``indexer``: keys visible to the query (the lightning indexer's scores, and the dense KL loss
  of the warm-up stage), for a kernel that skips invisible keys;
* ``attention``: valid slots ``min(index_topk, visible keys)`` (``sparse_mla`` reads only valid
  slots; the sparse KL loss likewise).

Rows: one 32K-token document (the worst case: long-context training), and rows packed from the
Python standard library's sources as byte tokens by the training example's pipeline
(examples/text_data.py; many short documents per row). ``imbalance`` = max / mean work over the
shards: a step waits for the slowest shard.

    .venv/bin/python benchmarks/model/cp_balance.py [--out [FILE]]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402  (also puts examples/ on sys.path)

import numpy as np  # noqa: E402
import text_data  # noqa: E402

from jax_dsa.sharding import causal_work, imbalance, to_zigzag, work_per_shard  # noqa: E402


def rows_single_document(seq_len):
    return [(np.arange(seq_len), np.zeros(seq_len, np.int64))]


def rows_packed_stdlib(seq_len, n_rows):
    corpus = text_data.load_corpus(max_bytes=seq_len * (n_rows + 1), heldout_fraction=0.05)
    packed = text_data.pack_documents(corpus.train_docs, seq_len)
    return [(packed.positions[i], packed.segment_ids[i]) for i in range(min(n_rows,
                                                                          len(packed.tokens)))]


def measure(rows, cps, topk):
    out = {}
    for cp in cps:
        entry = {}
        for workload, k in (("indexer", None), ("attention", topk)):
            per_layout = {}
            for layout in ("contiguous", "zigzag"):
                shards = np.zeros(cp, np.int64)
                for pos, seg in rows:
                    if layout == "zigzag":
                        pos, seg = (to_zigzag(np.asarray(x), cp, axis=0) for x in (pos, seg))
                    # Padding (segment 0 in packed rows) is a document of its own: counted too.
                    shards += work_per_shard(causal_work(pos, seg, topk=k), cp)
                per_layout[layout] = {"work_per_shard": shards.tolist(),
                                      "imbalance": round(imbalance(shards), 4)}
            entry[workload] = per_layout
        out[str(cp)] = entry
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--topk", type=int, default=2048, help="index_topk (GLM-5, DeepSeek V3.2)")
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--packed-rows", type=int, default=8)
    common.add_result_args(p)
    args = p.parse_args(argv)

    results = {
        "single_document": measure(rows_single_document(args.seq_len), args.cp, args.topk),
        "packed_stdlib": measure(rows_packed_stdlib(args.seq_len, args.packed_rows), args.cp,
                                 args.topk),
    }
    report = {
        "seq_len": args.seq_len, "index_topk": args.topk, "cp": args.cp,
        "packed_rows": args.packed_rows,
        "work_units": {"indexer": "visible keys per query",
                       "attention": "valid slots per query = min(index_topk, visible keys)"},
        "benchmark": "benchmarks/model/cp_balance.py", "commit": common.commit(args.commit),
        "date": common.today(),
        "results": results,
    }
    for rows, by_cp in results.items():
        for cp, entry in by_cp.items():
            for workload, lay in entry.items():
                print(f"{rows:16s} cp={cp} {workload:9s} contiguous "
                      f"{lay['contiguous']['imbalance']:.3f}x  zigzag "
                      f"{lay['zigzag']['imbalance']:.3f}x")
    common.write_json(common.out_path(args.out, __file__), report)
    return report


if __name__ == "__main__":
    main()
