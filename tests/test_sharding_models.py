"""The Flax DSA language model under the default logical-axis rules equals its unsharded run.

The tiny GLM-5 model (2 layers, index_topk 8 < 32 tokens, so the sparse stage selects) runs on
a dp=2, cp=2, tp=2 mesh of 8 CPU devices with its parameters and batch placed by
:data:`jax_dsa.sharding.DEFAULT_RULES` and the layers' activation constraints; logits, the LM
and indexer losses and every parameter gradient are compared with one device. The zigzag
context-parallel layout (cp=4) gives the natural-order logits back after
:func:`jax_dsa.sharding.from_zigzag`. On a mesh of ``Explicit`` axes (the sharding is part of
every array's type) the same model runs and equals one device too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.configs import get_config
from jax_dsa.models.deepseek_v4.model import DeepseekV4LanguageModel
from jax_dsa.nn import DSALanguageModel
from jax_dsa.sharding import DEFAULT_RULES, axis_rules, from_zigzag, logical_to_spec, to_zigzag
from jax_dsa.sharding.constraints import explicit_axes
from meshes import assert_close, collectives

B, S = 2, 32
# DeepSeek V4 tiny cut to its first three layers: sliding window, CSA and HCA attention, the hash
# and a top-k MoE layer, hyper-connections (the fourth layer repeats CSA and costs compile time).
V4, V4_OVERRIDES = "deepseek-v4-tiny", {"num_hidden_layers": 3}


def make_mesh(sizes, axis_type=AxisType.Auto):
    n = int(np.prod(list(sizes.values())))
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes),
                         axis_types=(axis_type,) * len(sizes), devices=jax.devices()[:n])


@functools.cache
def model_and_batch(preset="glm5-tiny", **overrides):
    """Model pieces and a packed batch; index_topk 8 keeps the top-k selective (32 tokens for
    GLM-5 tiny, 64 for V4 tiny: 16 compressed entries at its CSA ratio 4)."""
    config = get_config(preset, index_topk=8, **overrides)
    v4 = preset.startswith("deepseek-v4")
    model = (DeepseekV4LanguageModel if v4 else DSALanguageModel)(config, rngs=nnx.Rngs(0))
    s = 2 * S if v4 else S
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    # O(1) weights so that attention and the indexer scores are far from uniform.
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: jnp.asarray(
            1.0 + 0.2 * rng.standard_normal(x.shape) if x.ndim == 1
            else rng.standard_normal(x.shape) * 1.5 * x.shape[-1] ** -0.5, x.dtype),
        nnx.to_pure_dict(state))
    logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
    ids = rng.integers(0, config.vocab_size, (B, s)).astype(np.int32)
    cut = s * 5 // 8
    seg = np.ones((B, s), np.int32)
    seg[1, cut:] = 2  # row 1 packs two documents
    pos = np.tile(np.arange(s, dtype=np.int32), (B, 1))
    pos[1, cut:] -= cut
    return graphdef, params, rest, logical, (ids, pos, seg)


@functools.cache
def step(graphdef, mode):
    """Jitted: logits, losses and gradients of ``lm + indexer`` w.r.t. every parameter."""

    def loss(params, rest, ids, pos, seg, targets):
        model = nnx.merge(graphdef, params, rest)
        logits, aux = model(ids, pos, seg, attention_mode=mode)
        by_row = logits
        if explicit_axes():  # optax gathers the target's logit: the vocab comes whole
            rows = jax.typeof(logits).sharding.spec[:2]
            by_row = jax.sharding.reshard(logits, P(*rows, None))
            targets = jax.sharding.reshard(targets, P(*rows))
        lm = optax.softmax_cross_entropy_with_integer_labels(by_row, targets).mean()
        return lm + aux["indexer_loss"], (logits, lm, aux["indexer_loss"])

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def config_of(graphdef):
    return nnx.merge(graphdef, model_and_batch()[1], model_and_batch()[2]).config


def targets_of(ids):
    return np.roll(ids, -1, axis=1)


def place(mesh, params, logical, batch):
    shardings = jax.tree.map(
        lambda names, x: NamedSharding(mesh, logical_to_spec(tuple(names), mesh=mesh,
                                                             shape=x.shape)),
        logical, params, is_leaf=lambda x: isinstance(x, P))
    params = jax.device_put(params, shardings)
    tokens = NamedSharding(mesh, logical_to_spec(("batch", "sequence"), mesh=mesh))
    return params, shardings, [jax.device_put(x, tokens) for x in batch]


def check(got, want):
    (_, (logits, lm, idx_loss)), grads = got
    (_, (w_logits, w_lm, w_idx_loss)), w_grads = want
    assert_close(logits, w_logits, what="logits")
    assert_close(lm, w_lm, what="lm loss")
    assert_close(idx_loss, w_idx_loss, what="indexer loss")
    flat_got = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
    for path, w in jax.tree_util.tree_flatten_with_path(w_grads)[0]:
        name = jax.tree_util.keystr(path)
        # V4's hyper-connection scales and biases (3 to 8 numbers a site) sum cancelling
        # per-token terms over the whole batch: float32 summation order shows at ~1e-4
        rel = 1e-3 if any(k in name for k in ("_hc']['scale", "_hc']['base", "hc_head']['hc_s",
                                                "hc_head']['hc_b")) else 1e-5
        assert_close(flat_got[path], w, rel=rel, what="grad " + name)


def test_model_under_default_rules_equals_unsharded():
    """Sparse attention (the dense form runs under context parallelism in the zigzag test)."""
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch()
    f = step(graphdef, "sparse")
    want = f(params, rest, ids, pos, seg, targets_of(ids))
    mesh = make_mesh({"dp": 2, "cp": 2, "tp": 2})
    with jax.set_mesh(mesh):
        p, shardings, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
        compiled = f.lower(p, rest, *batch).compile()
        got = compiled(p, rest, *batch)
    check(got, want)
    # Per layer: kv and the indexer keys gathered along the sequence and their gradients
    # reduce-scattered back; no collective of a query's shape [b, s, heads, d] at all.
    ops = collectives(compiled.as_text())
    layers = len(params["layers"])
    b, s = B // 2, S // 2
    d_qk = config_of(graphdef).kv_lora_rank + config_of(graphdef).qk_rope_head_dim
    d_i = config_of(graphdef).index_head_dim
    assert not [s_ for _, shapes in ops for s_ in shapes if len(s_) == 4], ops  # q-like
    gathers = sorted(s_ for op, shapes in ops if op == "all-gather" for s_ in shapes)
    assert gathers.count((b, S, d_qk)) == layers and gathers.count((b, S, d_i)) == layers, ops
    scatters = sorted(s_ for op, shapes in ops if op == "reduce-scatter" for s_ in shapes)
    assert scatters == sorted([(b, s, d_qk)] * layers + [(b, s, d_i)] * layers), ops
    # The rules really split the model: heads and the MLP over tp, tokens over dp and cp.
    attn = shardings["layers"][0]["self_attn"]
    assert attn["q_b_proj"]["weight"].spec == P("tp", None)
    assert attn["o_proj"]["weight"].spec == P(None, "tp")
    assert attn["indexer"]["wq_b"]["weight"].spec == P(None, None)  # duplicated indexer
    assert shardings["layers"][0]["mlp"]["down_proj"]["weight"].spec == P(None, "tp")
    assert got[0][1][0].sharding.spec == P("dp", "cp", "tp")  # logits [batch, seq, vocab]
    assert got[1]["layers"][0]["self_attn"]["q_b_proj"]["weight"].sharding.spec == P("tp", None)


def test_zigzag_layout_gives_the_natural_order_back():
    """Tokens, positions and segment ids in zigzag order on cp=4: the logits, put back in
    natural order, and the losses and gradients equal the unsharded natural-order run (dense
    attention: every visible key, so no top-k ties can differ)."""
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch()
    f = step(graphdef, "dense")
    want = f(params, rest, ids, pos, seg, targets_of(ids))
    cp = 4
    zz = [to_zigzag(x, cp) for x in (ids, pos, seg, targets_of(ids))]
    assert not np.array_equal(zz[1], pos)
    mesh = make_mesh({"cp": cp})
    with jax.set_mesh(mesh):
        p, _, batch = place(mesh, params, logical, zz)
        (total, (logits, lm, idx_loss)), grads = f(p, rest, *batch)
    logits = from_zigzag(logits, cp)
    check(((total, (logits, lm, idx_loss)), grads), want)


@pytest.mark.parametrize("mode,overrides", [
    ("sparse", ()), ("dense", ()),
    # MoE on every layer with group-limited routing (2 groups, 1 kept)
    ("sparse", (("mlp_layer_types", ("sparse", "sparse")), ("n_group", 2), ("topk_group", 1))),
])
def test_model_on_explicit_axes_equals_unsharded(mode, overrides):
    """dp=2, cp=2, tp=2 of Explicit axes: the embedding gather and the projections name their
    output sharding (dense mode: dense_mla gathers the key positions itself, as kv), and the
    ops' custom VJP returns each cotangent typed like its primal (d_attn_sink comes out of the
    head-split backward); the MoE experts run per token shard under shard_map; logits, losses
    and every gradient equal one device, with the same placement as under Auto axes."""
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch(
        "glm5-tiny", **dict(overrides))
    f = step(graphdef, mode)
    want = f(params, rest, ids, pos, seg, targets_of(ids))
    mesh = make_mesh({"dp": 2, "cp": 2, "tp": 2}, AxisType.Explicit)
    with jax.set_mesh(mesh):
        p, _, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
        got = f(p, rest, *batch)
    check(got, want)
    assert jax.typeof(got[0][1][0]).sharding.spec == P("dp", "cp", "tp")  # logits
    grad = got[1]["layers"][0]["self_attn"]
    assert jax.typeof(grad["q_b_proj"]["weight"]).sharding.spec == P("tp", None)
    assert jax.typeof(grad["o_proj"]["weight"]).sharding.spec == P(None, "tp")


def test_deepseek_v4_model_under_default_rules_equals_unsharded():
    """DeepSeek V4 tiny (sliding, CSA and HCA layers; the CSA top-k selects 8 of 16 entries) on
    dp=2, cp=2, tp=2 of Auto axes: the compressor's windows cross sequence shards, the grouped
    output projection splits by head group."""
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch(V4, **V4_OVERRIDES)
    f = step(graphdef, "sparse")
    want = f(params, rest, ids, pos, seg, targets_of(ids))
    mesh = make_mesh({"dp": 2, "cp": 2, "tp": 2})
    with jax.set_mesh(mesh):
        p, shardings, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
        got = f(p, rest, *batch)
    check(got, want)
    attn = shardings["layers"][1]["self_attn"]
    assert attn["q_b_proj"]["weight"].spec == P("tp", None)
    assert attn["o_a_proj"]["weight"].spec == P("tp", None) and attn["sinks"].spec == P("tp")


@pytest.mark.parametrize("sizes,mode", [({"dp": 2, "cp": 2, "tp": 2}, "sparse"),
                                        pytest.param({"tp": 4}, "dense", marks=pytest.mark.slow)])
def test_deepseek_v4_model_on_explicit_axes_equals_unsharded(sizes, mode):
    """V4 tiny on Explicit axes: the compression layout and windows come whole along the
    sequence, the CSA indexer loss is split like V3.2's (its d index_k typed like index_k,
    which comes whole), and with tp=4 the two
    output groups cannot take the head split (the grouped weight comes whole)."""
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch(V4, **V4_OVERRIDES)
    f = step(graphdef, mode)
    want = f(params, rest, ids, pos, seg, targets_of(ids))
    mesh = make_mesh(sizes, AxisType.Explicit)
    with jax.set_mesh(mesh):
        p, _, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
        got = f(p, rest, *batch)
    check(got, want)


@pytest.mark.slow
def test_explicit_axes_take_any_token_placement():
    """Token ids placed as the caller likes (replicated, batch on tp, sequence on tp) and the
    default positions: the models put ids, positions and segment ids where the rules want them,
    so every placement gives the one-device logits (GLM-5 and V4 tiny, dp=2, tp=2)."""
    mesh = make_mesh({"dp": 2, "tp": 2}, AxisType.Explicit)
    for preset in ("glm5-tiny", V4):
        graphdef, params, rest, _, (ids, _, _) = model_and_batch(
            preset, **(V4_OVERRIDES if preset == V4 else {}))
        model = nnx.merge(graphdef, params, rest)
        want, _ = model(ids)
        with jax.set_mesh(mesh):
            for spec in (P(), P("tp", None), P(None, "tp")):
                got, _ = jax.jit(lambda ids: model(ids))(jax.device_put(ids, spec))
                assert_close(got, want, what=f"{preset} logits, ids placed {spec}")


def test_heads_axis_that_does_not_divide_the_head_count():
    """tp = 8 over 4 heads: the fused q projection (4 heads x 48) would split where the heads
    cannot, so the layers raise at trace time, naming the count, the mesh axes and the rule
    (GLM-5 on Auto axes, V4 on Explicit ones); with ``heads`` mapped to None the same mesh
    runs and equals one device. GLM-5's indexer heads over tp = 8 run on Auto axes (as they did
    before the check) and raise on Explicit ones."""
    for preset, kind in (("glm5-tiny", AxisType.Auto), (V4, AxisType.Explicit)):
        graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch(
            preset, **(V4_OVERRIDES if preset == V4 else {}))
        mesh = make_mesh({"tp": 8}, kind)
        with jax.set_mesh(mesh):
            p, _, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
            with pytest.raises(ValueError, match=r"num_attention_heads = 4 does not split over "
                               r"mesh axes \('tp',\) \(size 8\).*'heads'"):
                step.__wrapped__(graphdef, "sparse")(p, rest, *batch)  # a fresh trace
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch()
    want = step(graphdef, "sparse")(params, rest, ids, pos, seg, targets_of(ids))
    rules = tuple((name, None if name == "heads" else axis) for name, axis in DEFAULT_RULES)
    mesh = make_mesh({"tp": 8}, AxisType.Explicit)
    with jax.set_mesh(mesh), axis_rules(rules):
        p, _, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
        got = step.__wrapped__(graphdef, "sparse")(p, rest, *batch)
    check(got, want)
    # GLM-5's indexer heads (4) over tp=8 on Auto axes: the partitioner reshards the fused
    # projection itself, so that runs (and equals one device); on Explicit axes it raises.
    rules = tuple((name, {"heads": None, "index_heads": "tp"}.get(name, axis))
                  for name, axis in DEFAULT_RULES)
    auto = make_mesh({"tp": 8})
    with jax.set_mesh(auto), axis_rules(rules):
        p, _, batch = place(auto, params, logical, (ids, pos, seg, targets_of(ids)))
        got = step.__wrapped__(graphdef, "sparse")(p, rest, *batch)
    check(got, want)
    with jax.set_mesh(mesh), axis_rules(rules):
        p, _, batch = place(mesh, params, logical, (ids, pos, seg, targets_of(ids)))
        with pytest.raises(ValueError, match="index_n_heads = 4 does not split"):
            step.__wrapped__(graphdef, "sparse")(p, rest, *batch)


def test_gradients_inside_a_user_shard_map():
    """GLM-5 tiny's summed LM loss and every parameter gradient computed inside the caller's
    shard_map, Manual over dp only (tp stays Auto; check_vma on): the gradients of the
    replicated parameters come summed over the batch shards and equal one device."""
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch()

    def loss(params, rest, ids, pos, seg, targets):
        logits, aux = nnx.merge(graphdef, params, rest)(ids, pos, seg, attention_mode="sparse")
        lm = optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()
        return lm + aux["indexer_loss"] * ids.shape[0]  # per-row mean: sums over shards

    batch = (ids, pos, seg, targets_of(ids))
    want = jax.jit(jax.value_and_grad(loss))(params, rest, *batch)
    mesh = make_mesh({"dp": 2, "tp": 2})

    def local(params, rest, *batch):
        value, grads = jax.value_and_grad(loss)(params, rest, *batch)
        return jax.lax.psum(value, "dp"), grads

    with jax.set_mesh(mesh):
        p, _, placed = place(mesh, params, logical, batch)
        got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P()) + (P("dp"),) * 4,
                                    out_specs=(P(), P()), axis_names={"dp"}))(p, rest, *placed)
    assert_close(got[0], want[0], what="loss")
    flat = dict(jax.tree_util.tree_flatten_with_path(got[1])[0])
    for path, w in jax.tree_util.tree_flatten_with_path(want[1])[0]:
        assert_close(flat[path], w, what="grad " + jax.tree_util.keystr(path))
