"""How much neighbouring queries' top-k lists overlap, and how the selected keys spread: the
numbers a sparse-MLA backward design rests on (issue 48, benchmarks/notes/sparse_mla_bwd.md).

Indices come from one of these sources (``--source``, repeatable), each on single documents of
the Python standard library's sources as byte tokens (examples/text_data.py; the documents at
least ``--seq-len`` bytes long, held-out files first), one causal segment a row:

* ``uniform``: each query's ``topk`` keys drawn uniformly from its visible keys (what the kernel
  benchmarks feed the backward: no structure at all);
* ``init``: the lightning indexer of a freshly initialised ``--model`` (untrained, jax_dsa's
  init: linear weights ~ N(0, 0.02^2));
* ``trained``: the indexer of ``--model`` restored from ``examples/train.py``'s orbax
  ``--checkpoint-dir`` (its parameters; the newest step);
* ``hf``: the indexer of a Hugging Face checkpoint directory (``--hf-ckpt``, loaded with
  :func:`jax_dsa.interop.load_hf`), e.g. one that tests/hf_reference/hf_reference.py builds for
  the interop tests (random weights ~ N(0, 1/fan_in)).

For the model sources the layers run as the model does (sparse attention at the config's
``index_topk``); each indexer layer's top-``max(--topk)`` is taken from its own inputs, and a
smaller ``topk`` is its prefix (``indexer_topk`` returns descending scores). ``--layers``
limits how deep it goes (``0``: only the first layer, no attention run: long sequences).

Metrics, over the *full* queries only (position >= topk, so that the list is a proper subset of
the visible keys; aligned blocks of B consecutive queries):

* ``load_ratio[B]``: |union of the B queries' top-k sets| / (B * topk), B in --blocks: the
  share of per-query kv loads (and per-query dKV reductions) a kernel that shares rows across a
  block of B queries still does (1 - it: what it saves);
* ``jaccard_adjacent``: mean |A & B| / |A | B| of queries t and t + 1;
* ``blocks64_per_query``: distinct 64-key blocks a query's top-k touches (topk/64 at best);
  ``keys_in_blocks_with``: the share of a query's keys in 64-key blocks from which it selects
  at least 16 / 32 / 64 keys (a dense band, e.g. the local window);
* ``kv_major``: per 64-query block and each 64-key block that some of its queries select from:
  how many of the 64 queries select a key in it (mean, p50, p90, and the mean weighted by the
  selected pairs), the tile's density (selected (query, key) pairs / 64*64), and the 64-key
  blocks one 64-query block touches;
* ``local``: share of the selected keys within the last 64 / 512 positions and in the first 64.

    .venv/bin/python benchmarks/tools/topk_overlap.py --source uniform --source init \
        --seq-len 1024 --topk 128 --topk 256 --docs 2 --out
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks import common  # noqa: E402  (also puts examples/ on sys.path)

import numpy as np  # noqa: E402

BLOCKS = (1, 2, 4, 8, 16, 32, 64)
SOURCES = ("uniform", "init", "trained", "hf")


# ---------------------------------------------------------------------------------------------
# metrics on one [S, K] list (one document, positions 0..S-1, -1 = no slot)

def _distinct_per_row(a):
    """Distinct non-negative values per row of an int array ``[N, M]``."""
    s = np.sort(a, axis=1)
    new = np.ones_like(s, dtype=bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return np.sum(new & (s >= 0), axis=1)


def metrics(idx: np.ndarray, blocks=BLOCKS) -> dict:
    """The metrics above for ``idx [S, K]`` (every full query's K slots valid and distinct)."""
    s, k = idx.shape
    t0 = -(-k // 64) * 64  # the first full query, aligned to 64: query t sees t + 1 keys
    full = idx[t0:].astype(np.int64)
    n = full.shape[0]
    assert n >= 64, f"S {s} leaves {n} full queries at topk {k}: need >= 64"
    assert (full >= 0).all(), "a full query has an invalid slot"
    out = {"full_queries": int(n), "first_full_query": int(t0)}
    ratio = {}
    for b in blocks:
        m = n // b * b
        u = _distinct_per_row(full[:m].reshape(m // b, b * k))
        ratio[str(b)] = round(float(np.mean(u) / (b * k)), 4)
    out["load_ratio"] = ratio
    pair = np.concatenate([full[:-1], full[1:]], axis=1)
    union = _distinct_per_row(pair)
    jac = (2 * k - union) / union
    out["jaccard_adjacent"] = round(float(np.mean(jac)), 4)
    out["jaccard_adjacent_p10_p50_p90"] = [round(float(x), 4)
                                          for x in np.percentile(jac, [10, 50, 90])]
    kb = full // 64
    nb = _distinct_per_row(kb)
    out["blocks64_per_query"] = round(float(np.mean(nb)), 2)
    out["blocks64_per_query_min"] = -(-k // 64)
    out["keys_per_touched_block64"] = round(float(k / np.mean(nb)), 2)
    # how many of a query's keys sit in 64-key blocks it selects densely (>= 16 / 32 / 64 keys)
    nkb_all = s // 64 + 1
    _, cnt = np.unique((np.arange(n)[:, None] * nkb_all + kb).reshape(-1), return_counts=True)
    out["keys_in_blocks_with"] = {f">={t}": round(float(cnt[cnt >= t].sum() / cnt.sum()), 4)
                                  for t in (16, 32, 64)}
    # kv-major: (64-query block, 64-key block) tiles
    m = n // 64 * 64
    qb = np.repeat(np.arange(m) // 64, k)
    keyb = kb[:m].reshape(-1)
    nkb = s // 64 + 1
    tile = qb * nkb + keyb
    pairs_per_tile = np.bincount(tile)  # selected (query, key) pairs per tile
    # queries per tile: distinct (query, key block) pairs, counted per tile
    qk = (np.arange(m)[:, None] * nkb + kb[:m]).reshape(-1)
    qk = np.unique(qk)
    q_of, kb_of = qk // nkb, qk % nkb
    qcount = np.bincount((q_of // 64) * nkb + kb_of)
    touched = qcount > 0
    qc, pc = qcount[touched], pairs_per_tile[touched]
    out["kv_major"] = {
        "queries_per_tile_mean": round(float(qc.mean()), 2),
        "queries_per_tile_p50_p90": [float(np.percentile(qc, 50)), float(np.percentile(qc, 90))],
        "queries_per_tile_pair_weighted": round(float(np.sum(qc * pc) / np.sum(pc)), 2),
        "tile_density": round(float(pc.sum() / (64 * 64 * touched.sum())), 4),
        "tiles_per_qblock64": round(float(touched.sum() / (m // 64)), 1),
        "visible_blocks64_per_qblock64": round(float(np.mean(
            [(t0 + 64 * i + 63) // 64 + 1 for i in range(m // 64)])), 1),
    }
    t = np.arange(t0, s)[:, None]
    d = t - full
    out["local"] = {"last64": round(float(np.mean(d < 64)), 4),
                    "last512": round(float(np.mean(d < 512)), 4),
                    "first64": round(float(np.mean(full < 64)), 4)}
    return out


def average(results: list[dict]) -> dict:
    """Mean of the numeric leaves of several :func:`metrics` results (same keys)."""
    first = results[0]
    out = {}
    for key, v in first.items():
        if isinstance(v, dict):
            out[key] = average([r[key] for r in results])
        elif isinstance(v, list):
            out[key] = [round(float(np.mean([r[key][i] for r in results])), 4)
                        for i in range(len(v))]
        else:
            out[key] = round(float(np.mean([r[key] for r in results])), 4)
    return out


# ---------------------------------------------------------------------------------------------
# sources

def uniform_indices(s: int, k: int, rng) -> np.ndarray:
    """Each query's ``k`` keys uniform over its visible ``t + 1`` keys, sorted; -1 padded."""
    idx = np.full((s, k), -1, np.int32)
    for t in range(s):
        if t + 1 <= k:
            idx[t, : t + 1] = np.arange(t + 1)
        else:
            idx[t] = np.sort(rng.choice(t + 1, size=k, replace=False))
    return idx


def documents(seq_len: int, n: int) -> list[np.ndarray]:
    """``n`` token rows of ``seq_len`` bytes, each the start of one standard-library file at
    least that long (held-out files first, then training files, in the corpus' order)."""
    import text_data

    corpus = text_data.load_corpus(max_bytes=64 * 2**20, heldout_fraction=0.05)
    docs = [d for d in corpus.heldout_docs if len(d) >= seq_len]
    docs += [d for d in corpus.train_docs if len(d) >= seq_len]
    if len(docs) < n:
        raise SystemExit(f"only {len(docs)} documents of >= {seq_len} bytes")
    return [text_data.encode(d[:seq_len]) for d in docs[:n]]


def load_model(source: str, args):
    import jax.numpy as jnp
    from flax import nnx

    from jax_dsa.configs import get_config
    from jax_dsa.nn import DSALanguageModel

    if source == "hf":
        from jax_dsa.interop import load_hf

        return load_hf(args.hf_ckpt, dtype=jnp.float32)
    model = DSALanguageModel(get_config(args.model), rngs=nnx.Rngs(args.seed))
    if source == "trained":
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(pathlib.Path(args.checkpoint_dir).absolute())
        step = mgr.latest_step()
        if step is None:
            raise SystemExit(f"no checkpoint step in {args.checkpoint_dir}")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        state = mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore()))["state"]
        nnx.replace_by_pure_dict(params, state["params"])
        if (pathlib.Path(args.checkpoint_dir) / str(step) / "rest").exists():
            saved = mgr.restore(step, args=ocp.args.Composite(
                rest=ocp.args.StandardRestore()))["rest"]
            nnx.replace_by_pure_dict(rest, saved)
        model = nnx.merge(graphdef, params, rest)
        model.trained_step = step
    return model


def model_indices(model, tokens: np.ndarray, k: int, layers: int | None) -> dict[int, np.ndarray]:
    """Each indexer layer's top-``k`` ``[S, k]`` on one document (layers up to ``layers``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_dsa.nn.rope import rope_cos_sin
    from jax_dsa.ops.indexer import indexer_topk

    c = model.config
    last = c.num_hidden_layers - 1 if layers is None else min(layers, c.num_hidden_layers - 1)

    @nnx.jit
    def run(model, ids):
        s = ids.shape[1]
        positions = jnp.arange(s, dtype=jnp.int32)[None]
        cos, sin = rope_cos_sin(positions, c.rope_parameters, c.qk_rope_head_dim)
        x = model.embed_tokens(ids)
        out = {}
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            if attn.indexer is not None:
                xn = layer.input_layernorm(x)
                c_q = attn.q_a_layernorm(attn.q_a_proj(xn))
                iq, ik, w = attn.indexer(xn, c_q, cos, sin)
                out[i] = indexer_topk(iq, ik, w, topk=k, q_positions=positions,
                                      kv_positions=positions, implementation="xla")[0]
            if i == last:
                break
            x, _ = layer(x, positions, None, attention_mode="sparse",
                         compute_indexer_loss=False)
        return out

    res = run(model, jnp.asarray(tokens, jnp.int32)[None])
    return {i: np.asarray(jax.device_get(v)) for i, v in res.items()}


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--source", action="append", choices=SOURCES,
                   help="where the indices come from (repeatable; default: uniform and init)")
    p.add_argument("--seq-len", type=int, action="append",
                   help="document length S (repeatable; default 1024)")
    p.add_argument("--topk", type=int, action="append",
                   help="top-k sizes (repeatable; default S/8 of each S); a topk >= S is skipped")
    p.add_argument("--topk-fraction", type=float, action="append",
                   help="top-k as a fraction of S (repeatable, added to --topk)")
    p.add_argument("--docs", type=int, default=2, help="documents per (source, S)")
    p.add_argument("--layers", type=int, default=None,
                   help="deepest layer to run (0: the first layer only, no attention)")
    p.add_argument("--model", default="glm5-small", help="preset for init / trained")
    p.add_argument("--checkpoint-dir", default=None, help="examples/train.py's orbax folder")
    p.add_argument("--hf-ckpt", default=None, help="a Hugging Face checkpoint folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    p.add_argument("--label", action="append", default=[],
                   help="KEY=VALUE notes stored in the result (e.g. how the checkpoint was made)")
    p.add_argument("--append", action="store_true",
                   help="keep the runs of an existing result file (other source, S, topk)")
    common.add_result_args(p)
    args = p.parse_args(argv)
    sources = args.source or ["uniform", "init"]
    seq_lens = args.seq_len or [1024]

    runs = []
    models = {}
    commit, command = common.commit(args.commit), " ".join(sys.argv)
    for s in seq_lens:
        ks = set(args.topk or [])
        ks |= {int(round(f * s)) for f in (args.topk_fraction or [])}
        if not ks:
            ks = {s // 8}
        ks = sorted(k for k in ks if k < s and s - -(-k // 64) * 64 >= 64)
        if not ks:
            continue
        docs = documents(s, args.docs)
        for source in sources:
            t_start = time.perf_counter()
            per = {k: {} for k in ks}  # k -> layer -> [metrics per doc]
            if source == "uniform":
                rng = np.random.default_rng(args.seed)
                for k in ks:
                    per[k]["-"] = [metrics(uniform_indices(s, k, rng), args.blocks)
                                   for _ in docs]
            else:
                if source not in models:
                    models[source] = load_model(source, args)
                model = models[source]
                for tokens in docs:
                    got = model_indices(model, tokens, max(ks), args.layers)
                    for layer, idx in got.items():
                        for k in ks:
                            per[k].setdefault(str(layer), []).append(
                                metrics(idx[:, :k], args.blocks))
            for k in ks:
                layers = {layer: average(v) for layer, v in per[k].items()}
                run = {"source": source, "seq_len": s, "topk": k, "docs": len(docs),
                       "commit": commit, "command": command,
                       "mean_over_layers": average(list(layers.values())), "per_layer": layers}
                if source == "trained":
                    run["checkpoint_step"] = int(models[source].trained_step)
                    run["checkpoint_dir"] = args.checkpoint_dir
                if source == "hf":
                    run["hf_ckpt"] = args.hf_ckpt
                if source != "uniform":
                    run["layers_run"] = args.layers
                runs.append(run)
                m = run["mean_over_layers"]
                lr = m["load_ratio"]
                print(f"{source:8s} S {s:6d} topk {k:5d}: load_ratio "
                      + " ".join(f"B{b}={lr[b]:.3f}" for b in lr)
                      + f" | jaccard {m['jaccard_adjacent']:.3f}"
                      + f" | blocks64/query {m['blocks64_per_query']:.1f}"
                      + f" (min {-(-k // 64)})"
                      + f" | q/tile {m['kv_major']['queries_per_tile_mean']:.1f}"
                      + f" density {m['kv_major']['tile_density']:.3f}",
                      flush=True)
            print(f"  ({source}, S {s}: {time.perf_counter() - t_start:.1f} s)", flush=True)

    result = {
        "tool": "benchmarks/tools/topk_overlap.py",
        "commit": commit,
        "date": common.today(),
        "command": command,
        "device": "cpu",
        "model": args.model,
        "checkpoint_dir": args.checkpoint_dir,
        "hf_ckpt": args.hf_ckpt,
        "labels": dict(x.split("=", 1) for x in args.label),
        "blocks": args.blocks,
        "runs": runs,
    }
    path = common.out_path(args.out, __file__)
    if args.append and path is not None and path.exists():
        import json

        old = json.loads(path.read_text())
        new_keys = {(r["source"], r["seq_len"], r["topk"]) for r in runs}
        result["runs"] = [r for r in old["runs"]
                          if (r["source"], r["seq_len"], r["topk"]) not in new_keys] + runs
        result["labels"] = {**old.get("labels", {}), **result["labels"]}
        result["earlier_commands"] = old.get("earlier_commands", []) + [old["command"]]
    common.write_json(path, result)
    return result


if __name__ == "__main__":
    main()
