"""Tests of the training example (examples/train.py) and its data pipeline (examples/text_data.py).

The data tests compare against brute-force Python oracles written here. The training tests run
``main()`` in-process for a few steps of the tiny GLM-5 model (seq_len 128 > index_topk 64, so
the sparse stage really is sparse) and check the metrics file, the checkpoint, one compiled
program per attention mode, and that 2 steps + resume 2 steps equals 4 straight steps.
"""

import importlib.util
import json
import math
import pathlib
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import text_data  # noqa: E402


def _load_train():
    spec = importlib.util.spec_from_file_location("jax_dsa_example_train", EXAMPLES / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


train = _load_train()


# ---------------------------------------------------------------------------------------------
# Data pipeline


def _pack_oracle(docs, seq_len):
    """Row-by-row packing with splitting, one byte at a time."""
    tokens, segs, pos = [], [], []
    row_t, row_s, row_p = [], [], []
    for doc in docs:
        if not doc:
            continue
        seg, p = None, 0
        for byte in doc:
            if len(row_t) == seq_len:
                tokens.append(row_t), segs.append(row_s), pos.append(row_p)
                row_t, row_s, row_p = [], [], []
                seg = None
            if seg is None:  # a new piece: next segment number of this row
                seg, p = (row_s[-1] + 1 if row_s else 1), 0
            row_t.append(byte), row_s.append(seg), row_p.append(p)
            p += 1
        # The next document starts a new piece.
    if row_t:
        pad = seq_len - len(row_t)
        tokens.append(row_t + [0] * pad), segs.append(row_s + [0] * pad)
        pos.append(row_p + [0] * pad)
    return np.array(tokens), np.array(segs), np.array(pos)


def test_pack_documents_matches_oracle_and_round_trips():
    rng = np.random.default_rng(0)
    seq_len = 16
    lengths = [5, 16, 40, 1, 0, 15, 17, 32, 3, 9]  # shorter, equal, longer than a row; empty
    docs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    rows = text_data.pack_documents(docs, seq_len)
    want_t, want_s, want_p = _pack_oracle(docs, seq_len)
    np.testing.assert_array_equal(rows.tokens, want_t)
    np.testing.assert_array_equal(rows.segment_ids, want_s)
    np.testing.assert_array_equal(rows.positions, want_p)
    assert rows.tokens.dtype == rows.segment_ids.dtype == rows.positions.dtype == np.int32
    # Round trip: the non-padding tokens are the documents' bytes, in order.
    real = rows.segment_ids != text_data.PAD_SEGMENT_ID
    assert text_data.decode(rows.tokens[real]) == b"".join(docs)
    # Packing really mixes documents in a row (the packed-sequence path is exercised).
    assert (rows.segment_ids.max(axis=1) > 1).any()
    with pytest.raises(ValueError, match="seq_len"):
        text_data.pack_documents(docs, 1)
    with pytest.raises(ValueError, match="tokens must lie"):
        text_data.decode([256])


def test_next_token_targets_mask_boundaries_and_padding():
    segment_ids = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    tokens = np.arange(16).reshape(2, 8)
    targets, mask = text_data.next_token_targets(tokens, segment_ids)
    for b in range(2):
        for t in range(8):
            has_target = (t + 1 < 8 and segment_ids[b, t] != 0
                          and segment_ids[b, t + 1] == segment_ids[b, t])
            assert mask[b, t] == float(has_target)
            if t + 1 < 8:
                assert targets[b, t] == tokens[b, t + 1]


def test_corpus_split_is_disjoint_deterministic_and_cap_independent(tmp_path):
    for rel in ["a.py", "pkg/b.py", "pkg/sub/c.py", "z.py", "notes.txt",
                "site-packages/third.py", "pkg/__pycache__/d.py"]:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode() * 10)
    assert text_data.list_source_files(tmp_path) == ["a.py", "pkg/b.py", "pkg/sub/c.py", "z.py"]

    stdlib_files = text_data.list_source_files(text_data.stdlib_root())
    assert stdlib_files == sorted(stdlib_files) and len(stdlib_files) > 100
    assert not any("site-packages" in p for p in stdlib_files)
    held = [p for p in stdlib_files if text_data.is_heldout(p, 0.05)]
    assert 0.02 < len(held) / len(stdlib_files) < 0.09
    small = text_data.load_corpus(max_bytes=300_000, heldout_fraction=0.05)
    large = text_data.load_corpus(max_bytes=1_000_000, heldout_fraction=0.05)
    for corpus in (small, large):
        assert not set(corpus.train_paths) & set(corpus.heldout_paths)
        assert all(text_data.is_heldout(p, 0.05) for p in corpus.heldout_paths)
        assert not any(text_data.is_heldout(p, 0.05) for p in corpus.train_paths)
        assert corpus.num_bytes <= 1_000_000 and corpus.heldout_docs and corpus.train_docs
        root = pathlib.Path(corpus.root)
        assert corpus.train_docs[0] == (root / corpus.train_paths[0]).read_bytes()
    # A larger cap extends both splits; it never moves a file between them.
    assert large.train_paths[: len(small.train_paths)] == small.train_paths
    assert large.heldout_paths[: len(small.heldout_paths)] == small.heldout_paths
    with pytest.raises(ValueError, match="heldout_fraction"):
        text_data.load_corpus(max_bytes=1000, heldout_fraction=1.0)


def test_row_sampler_is_a_pure_function_of_position():
    sampler = text_data.RowSampler(7, seed=3)
    stream = sampler.indices(0, 21)
    for epoch in range(3):  # each epoch is a permutation
        assert sorted(stream[7 * epoch: 7 * epoch + 7]) == list(range(7))
    assert not np.array_equal(stream[:7], stream[7:14])
    fresh = text_data.RowSampler(7, seed=3)
    np.testing.assert_array_equal(np.concatenate([fresh.indices(0, 5), fresh.indices(5, 16)]),
                                  stream)
    np.testing.assert_array_equal(text_data.RowSampler(7, seed=0, shuffle=False).indices(5, 4),
                                  [5, 6, 0, 1])


# ---------------------------------------------------------------------------------------------
# Pieces of the training script


def test_masked_cross_entropy_matches_float64_oracle():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    mask = (rng.random((2, 5)) < 0.6).astype(np.float32)
    x = logits.astype(np.float64)
    logz = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    nll = logz - np.take_along_axis(x, targets[..., None], -1)[..., 0]
    want = (nll * mask).sum() / mask.sum()
    got = float(train.masked_cross_entropy(logits, targets, mask))
    assert got == pytest.approx(want, rel=1e-6)
    assert float(train.masked_cross_entropy(logits, targets, 0 * mask)) == 0.0


def test_command_line_validation_and_sharding_rules():
    for bad in (["--mesh", "xp=2"], ["--mesh", "dp=0"], ["--resume"],
                ["--steps", "4", "--stop-at-step", "5"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    assert train.parse_args(["--mesh", "dp=2"]).mesh == {"dp": 2}
    assert train.parse_args(["--mesh", "dp=2,cp=2,tp=2"]).mesh == {"dp": 2, "cp": 2, "tp": 2}
    P = jax.sharding.PartitionSpec
    assert train.logical_to_mesh(("batch", "sequence")) == P(("dp", "ep"), "cp")
    assert train.logical_to_mesh(("vocab", "embed")) == P("tp", None)
    rules = (("heads", "tp"), ("batch", "dp"))
    assert train.logical_to_mesh(("heads", "q_lora"), rules) == P("tp", None)
    assert [train.attention_mode_at(i, 2) for i in range(4)] == ["dense", "dense", "sparse",
                                                               "sparse"]


# ---------------------------------------------------------------------------------------------
# Training runs

COMMON = ["--model", "glm5-tiny", "--batch", "2", "--seq-len", "128", "--steps", "4",
          "--warmup-steps", "1", "--eval-every", "0", "--eval-batches", "1",
          "--corpus-mb", "0.5", "--no-progress"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """4 steps (2 dense, 2 sparse) with a checkpoint every 2 steps; compiles from scratch."""
    tmp = tmp_path_factory.mktemp("straight")
    train._STEPS_CACHE.clear()
    metrics = train.main(COMMON + ["--dense-warmup-steps", "2", "--checkpoint-dir",
                                   str(tmp / "ckpt"), "--save-every", "2", "--metrics-out",
                                   str(tmp / "metrics.json")])
    return tmp, metrics


def _restore_state(ckpt_dir, step):
    return ocp.StandardCheckpointer().restore(pathlib.Path(ckpt_dir) / str(step) / "state")


def test_train_writes_metrics_and_checkpoints(straight_run):
    tmp, metrics = straight_run
    on_disk = json.loads((tmp / "metrics.json").read_text())
    assert on_disk["final_loss"] == metrics["final_loss"]
    for key in ("initial_loss", "final_loss", "steps", "tokens_per_s", "eval", "indexer_loss",
                "config", "wall_time_s", "jax_version", "device"):
        assert key in on_disk, key
    assert on_disk["steps"] == 4 and on_disk["jax_version"] == jax.__version__
    assert on_disk["device"]["platform"] == jax.devices()[0].platform
    # The sparse stage must really be sparse at this length for the test to mean anything.
    assert on_disk["config"]["vocab_size"] == 256 and on_disk["config"]["index_topk"] < 128
    assert on_disk["attention_mode"] == ["dense", "dense", "sparse", "sparse"]
    for key in ("train_loss", "indexer_loss", "total_loss", "grad_norm"):
        assert len(on_disk[key]) == 4 and all(math.isfinite(v) for v in on_disk[key]), key
    assert on_disk["initial_loss"] == on_disk["train_loss"][0]
    assert abs(on_disk["initial_loss"] - math.log(256)) < 0.5  # untrained: near uniform
    for lm, idx, total in zip(on_disk["train_loss"], on_disk["indexer_loss"],
                              on_disk["total_loss"]):
        assert total == pytest.approx(lm + 1.0 * idx, rel=1e-5)
    assert all(v >= 0 for v in on_disk["indexer_loss"])  # a KL divergence
    assert on_disk["tokens_per_s"] > 0 and on_disk["wall_time_s"] > 0
    assert on_disk["eval"] and on_disk["eval"][-1]["step"] == 4
    assert math.isfinite(on_disk["final_eval_loss"])
    # One train program per attention mode, compiled once each.
    assert on_disk["compilations"]["train"] == {"dense": 1, "sparse": 1}
    # Checkpoints at step 2 and at the end, with the step and data position.
    ckpt = tmp / "ckpt"
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [2, 4]
    meta = json.loads((ckpt / "4" / "meta" / "metadata").read_text())
    assert meta["step"] == 4 and meta["data_position"] == 4 * 2
    state = _restore_state(ckpt, 4)
    assert int(np.asarray(state["opt_state"][1][0]["count"])) == 4  # AdamW's step counter
    assert state["params"]["lm_head"]["weight"].shape == (256, on_disk["config"]["hidden_size"])


def test_resume_continues_exactly(straight_run, tmp_path):
    straight_tmp, straight = straight_run
    ckpt = tmp_path / "ckpt"
    args = COMMON + ["--dense-warmup-steps", "2", "--checkpoint-dir", str(ckpt)]
    first = train.main(args + ["--stop-at-step", "2"])
    assert first["steps"] == 2 and len(first["train_loss"]) == 2
    resumed = train.main(args + ["--resume"])
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4
    # The compiled programs are reused; nothing recompiles on resume.
    assert resumed["compilations"]["train"] == {"dense": 0, "sparse": 0}
    np.testing.assert_allclose(resumed["train_loss"], straight["train_loss"], rtol=1e-6)
    np.testing.assert_allclose(resumed["indexer_loss"], straight["indexer_loss"], rtol=1e-6,
                               atol=1e-9)
    # Same parameters and optimizer state after 4 steps; the straight run's mid-run checkpoint
    # (saved before the next step donated its buffers) equals the stopped run's final one.
    for step in (2, 4):
        a = _restore_state(straight_tmp / "ckpt", step)
        b = _restore_state(ckpt, step)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-7)


def test_loss_falls_on_a_fixed_batch(straight_run):
    metrics = train.main(COMMON + ["--dense-warmup-steps", "0", "--fixed-batch"])
    losses = metrics["train_loss"]
    assert all(math.isfinite(v) for v in losses)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.95 * losses[0], losses



def test_warmup_freeze_trains_only_the_indexer(monkeypatch):
    """--warmup-freeze (DeepSeek-V3.2 paper §2.1): two frozen dense warm-up steps change every
    indexer parameter and leave every other one bitwise unchanged (no weight decay either); the
    objective is the indexer loss alone and the step never runs the main attention's backward.
    Runs the example's own train step (get_steps) on a packed batch, without the corpus,
    evaluation or checkpoints."""
    from flax import nnx
    from jax.sharding import NamedSharding

    from jax_dsa.configs import get_config
    from jax_dsa.nn import DSALanguageModel
    from jax_dsa.ops.dense_mla import op as dense_op
    from jax_dsa.ops.dense_mla import xla as dense_xla
    from jax_dsa.ops.registry import Implementation, Registry, always

    backward_traces = []

    def counting_backward(*args):
        backward_traces.append(1)
        return dense_xla.IMPLEMENTATION.backward(*args)

    counting = Implementation("xla", always, dense_xla.IMPLEMENTATION.forward, counting_backward)
    monkeypatch.setattr(dense_op, "REGISTRY",
                        Registry("dense_mla", (counting,), preference={"default": ("xla",)}))

    args = train.parse_args(COMMON + ["--warmup-freeze"])
    assert args.warmup_freeze and not train.parse_args(COMMON).warmup_freeze
    # built abstractly, random values from NumPy: no initialiser compiles
    model = nnx.eval_shape(lambda: DSALanguageModel(get_config("glm5-tiny"), rngs=nnx.Rngs(0)))
    graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
    mesh = train.make_mesh({"dp": 1})
    param_sharding = train.param_shardings(mesh, param_state)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x, sh: train.global_array(
            (rng.standard_normal(x.shape) * x.shape[-1] ** -0.5 + (x.ndim == 1)).astype(x.dtype),
            sh),
        nnx.to_pure_dict(param_state), param_sharding)
    before = [np.array(x) for x in jax.tree.leaves(params)]
    batch_sharding = NamedSharding(mesh, train.logical_to_mesh(("batch", "sequence"), mesh=mesh))
    steps = train.get_steps(graphdef, params, train.OptimizerSettings.from_args(args), mesh,
                            implementation=None, indexer_loss_coeff=1.0,
                            param_sharding=param_sharding, batch_sharding=batch_sharding,
                            warmup_freeze=True)
    docs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (70, 150, 40)]
    rows = text_data.pack_documents(docs, 128)
    batch = train.place_batch(text_data.make_batch(rows, np.arange(2)), batch_sharding)
    opt_state = steps.init_opt_state(params)
    with jax.set_mesh(mesh):
        for _ in range(2):
            params, opt_state, stats = steps.train("dense", params, rest, opt_state, batch)
            stats = jax.device_get(stats)
            assert stats["total_loss"] == stats["indexer_loss"] > 0  # the LM loss is not in it
            assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert steps.traces["train"] == {"dense": 1, "sparse": 0}
    assert not backward_traces  # no gradient through the main attention
    # (the LM loss's gradient would run it: the count is live)
    jax.make_jaxpr(jax.grad(lambda p: train._forward(
        graphdef, p, rest, batch, attention_mode="dense", implementation=None)[0]))(params)
    assert backward_traces
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    n_indexer = 0
    for path, x, y in zip(paths, before, jax.tree.leaves(params)):
        y = np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        if "'indexer'" in path:
            n_indexer += 1
            assert not np.array_equal(x, y), path  # trained
        else:
            assert x.tobytes() == y.tobytes(), path  # frozen: bitwise unchanged
    assert n_indexer == 2 * 5  # per layer: wq_b, wk, k_norm.{weight,bias}, weights_proj


def test_indexer_qk_dtype_reaches_every_indexer():
    """--indexer-qk-dtype float8_e4m3fn: every GLM-5 lightning indexer of the model selects by
    the fp8 scores; a DeepSeek V4 model (no such indexer) is refused."""
    from flax import nnx

    from jax_dsa.configs import get_config
    from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
    from jax_dsa.models.glm.indexer import Indexer
    from jax_dsa.nn import DSALanguageModel

    args = train.parse_args(COMMON + ["--indexer-qk-dtype", "float8_e4m3fn"])
    assert args.indexer_qk_dtype == "float8_e4m3fn"
    assert train.parse_args(COMMON).indexer_qk_dtype is None
    with pytest.raises(SystemExit):
        train.parse_args(COMMON + ["--indexer-qk-dtype", "float8_e5m2"])
    config = get_config("glm5-tiny")
    model = nnx.eval_shape(lambda: DSALanguageModel(config, rngs=nnx.Rngs(0)))
    n = train.set_indexer_qk_dtype(model, args.indexer_qk_dtype)
    indexers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Indexer)]
    assert n == len(indexers) == sum(map(config.has_indexer, range(config.num_hidden_layers)))
    assert all(m.qk_dtype == "float8_e4m3fn" for m in indexers)
    v4 = nnx.eval_shape(lambda: DeepseekV4LanguageModel(get_config("deepseek-v4-tiny"),
                                                        rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="no GLM-5 / DeepSeek V3.2 lightning indexer"):
        train.set_indexer_qk_dtype(v4, "float8_e4m3fn")
