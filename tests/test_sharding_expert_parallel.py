"""Expert parallelism (the routed experts split over ``ep``, pairs moved by all-to-all) equals
one device, on the 8 CPU devices of tests/conftest.py.

* The experts layer alone (16 experts, top-4; experts 12-15 get no pair, so the devices that
  hold them receive none) on ``ep=8``, ``ep=4,dp=2``, ``ep=2,cp=2,tp=2``, ep folded over
  ``dp`` and over ``dp`` and ``cp`` (no ``ep`` axis: ``experts -> dp``), Explicit and Auto axes:
  outputs, tokens per expert and the gradients of the tokens, gate values and every weight.
* A capped buffer drops exactly the pairs numpy says, counts them, and the output equals one
  device with those pairs' gate values zeroed.
* GLM-5-style and DeepSeek V4-style tiny models (16 experts; V4: a hash-routed and top-k
  layers) on ep meshes: logits, losses, every gradient; the compiled step holds all-to-alls
  and no all-gather of expert weights, and each device holds 1/ep of them.
* A checkpoint loaded onto an ep mesh equals the one-device load.
* The ``"ragged"`` exchange (``ragged_all_to_all``, no XLA:CPU implementation) end to end:
  marked ``gpu``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.configs import get_config
from jax_dsa.nn.experts import Experts, set_expert_dispatch
from jax_dsa.sharding import DEFAULT_RULES, axis_rules, logical_to_spec
from meshes import assert_close, collectives, make_mesh
from test_sharding_models import V4, check, model_and_batch, place, step, targets_of

E, K, T = 16, 4, 64
FOLD_DP = tuple((n, "dp" if n == "experts" else a) for n, a in DEFAULT_RULES)
FOLD_DP_CP = tuple((n, ("dp", "cp") if n == "experts" else a) for n, a in DEFAULT_RULES)


@functools.cache
def experts_case():
    """An Experts layer (16 experts) and 64 tokens routed to experts 0-11 only."""
    config = get_config("glm5-tiny", n_routed_experts=E, num_experts_per_tok=K)
    graphdef, state = nnx.split(Experts(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, config.hidden_size)).astype(np.float32)
    idx = np.stack([rng.choice(12, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    return graphdef, state, x, w, idx


def experts_step(graphdef):
    """A fresh jit (each mesh and rule table traces its own program)."""
    def f(state, x, w, idx):
        def loss(state, x, w):
            y, load, overflow = nnx.merge(graphdef, state)(x, w, idx, return_load=True,
                                                           return_overflow=True)
            return (y * y).sum(), (y, load, overflow)
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(state, x, w)
        return out, grads
    return jax.jit(f)


def place_experts(mesh, state, *arrays):
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    values = nnx.to_pure_dict(state)
    placed = jax.tree.map(
        lambda s, v: jax.device_put(v, NamedSharding(mesh, logical_to_spec(
            tuple(s), mesh=mesh, shape=v.shape))), specs, values,
        is_leaf=lambda s: isinstance(s, P))
    state = jax.tree.map(lambda v: v, state)
    nnx.replace_by_pure_dict(state, placed)
    tokens = NamedSharding(mesh, logical_to_spec(("batch",), mesh=mesh, shape=(T,)))
    return state, [jax.device_put(a, tokens) for a in arrays]


def compare(got, want, what):
    for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
        g = dict(jax.tree_util.tree_flatten_with_path(got)[0])[path]
        assert_close(g, w, what=f"{what} {jax.tree_util.keystr(path)}")


LAYER_LAYOUTS = [
    pytest.param({"ep": 8}, AxisType.Explicit, DEFAULT_RULES, id="ep8"),
    pytest.param({"dp": 2, "ep": 4}, AxisType.Explicit, DEFAULT_RULES, id="dp2-ep4"),
    pytest.param({"ep": 2, "cp": 2, "tp": 2}, AxisType.Explicit, DEFAULT_RULES,
                 id="ep2-cp2-tp2", marks=pytest.mark.slow),  # the GLM model test runs it
    # ep folded over the data-parallel devices (no ep axis), then over dp and cp
    pytest.param({"dp": 8}, AxisType.Explicit, FOLD_DP, id="experts-on-dp8"),
    pytest.param({"dp": 2, "cp": 2, "tp": 2}, AxisType.Auto, FOLD_DP_CP,
                 id="experts-on-dp2-cp2-auto"),
    pytest.param({"ep": 8}, AxisType.Auto, DEFAULT_RULES, id="ep8-auto",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("sizes,kind,rules", LAYER_LAYOUTS)
def test_experts_layer_on_ep_meshes_equals_one_device(sizes, kind, rules):
    graphdef, state, x, w, idx = experts_case()
    want = experts_step(graphdef)(state, x, w, idx)
    mesh = make_mesh(sizes, kind)
    with jax.set_mesh(mesh), axis_rules(rules):
        placed, args = place_experts(mesh, state, x, w, idx)
        compiled = experts_step(graphdef).lower(placed, *args).compile()
        got = compiled(placed, *args)
    compare(got, want, f"{sizes}")
    assert "all-to-all" in {op for op, _ in collectives(compiled.as_text())}
    load = np.asarray(got[0][1])
    np.testing.assert_array_equal(load, np.bincount(idx.reshape(-1), minlength=E))
    assert load[12:].sum() == 0 and int(got[0][2]) == 0  # idle experts; nothing dropped


def _dropped(idx, groups, ep, capacity):
    """numpy: the pairs a capacity buffer drops. Token shard ``s`` (of ``groups * ep``, in
    order) is device ``s % ep`` of its ep group; its pairs sorted by expert (stable), the
    first ``capacity`` of each destination block go."""
    t, k = idx.shape
    shards = groups * ep
    per = t // shards
    el = E // ep
    drop = np.zeros(idx.shape, bool)
    for s in range(shards):
        flat = idx[s * per:(s + 1) * per].reshape(-1)
        order = np.argsort(flat, kind="stable")
        seen = np.zeros(ep, int)
        for r in order:
            dest = flat[r] // el
            seen[dest] += 1
            if seen[dest] > capacity:
                drop[s * per + r // k, r % k] = True
    return drop


def test_capped_capacity_drops_and_counts_exactly():
    """ep=4, dp=2 with capacity_factor 0.75: C = ceil(0.75 * 8 tokens * 4 / 4) = 6 rows per
    (source, destination) block. The overflow is numpy's count and the output is one device's
    with the dropped pairs' gate values zeroed (forward and gradients)."""
    graphdef, state, x, w, idx = experts_case()
    model = nnx.merge(graphdef, state)
    set_expert_dispatch(model, "capacity", 0.75)
    capped, state = nnx.split(model)
    drop = _dropped(idx, groups=2, ep=4, capacity=6)
    assert 0 < drop.sum() < drop.size
    want = experts_step(graphdef)(state, x, np.where(drop, 0, w).astype(np.float32), idx)
    mesh = make_mesh({"dp": 2, "ep": 4}, AxisType.Explicit)
    with jax.set_mesh(mesh):
        placed, args = place_experts(mesh, state, x, w, idx)
        got = experts_step(capped)(placed, *args)
    assert int(got[0][2]) == drop.sum()
    compare(got[0][0], want[0][0], "output")
    compare(got[1][0], want[1][0], "d weights")
    compare(got[1][1], want[1][1], "d x")
    # the dropped pairs' gate values get no gradient; the kept ones equal one device's
    d_w = np.asarray(got[1][2])
    assert (d_w[drop] == 0).all()
    assert_close(d_w[~drop], np.asarray(want[1][2])[~drop], what="d gate values")


def test_expert_axes_must_divide_the_experts():
    graphdef, state, x, w, idx = experts_case()
    mesh = make_mesh({"ep": 8}, AxisType.Explicit)
    config = get_config("glm5-tiny", n_routed_experts=12, num_experts_per_tok=K)
    layer = Experts(config, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"n_routed_experts = 12 does not "
                                           r"split over mesh axes \('ep',\) \(size 8\)"):
        layer(jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx))
    with pytest.raises(ValueError, match="dispatch must be one of"):
        set_expert_dispatch(layer, "dense")


# --- whole models ---------------------------------------------------------------------------


GLM = ("glm5-tiny", (("n_routed_experts", E), ("num_experts_per_tok", K),
                     ("mlp_layer_types", ("sparse", "sparse")), ("n_group", 2),
                     ("topk_group", 1)))
V4_EP = (V4, (("num_hidden_layers", 2), ("n_routed_experts", E)))  # hash, then top-k


@pytest.mark.parametrize("case,sizes,kind,rules", [
    (GLM, {"ep": 2, "cp": 2, "tp": 2}, AxisType.Explicit, DEFAULT_RULES),
    pytest.param(V4_EP, {"dp": 2, "ep": 4}, AxisType.Explicit, DEFAULT_RULES,
                 marks=pytest.mark.slow),
    pytest.param(GLM, {"ep": 8}, AxisType.Auto, DEFAULT_RULES, marks=pytest.mark.slow),
    pytest.param(V4_EP, {"ep": 8}, AxisType.Explicit, DEFAULT_RULES, marks=pytest.mark.slow),
    pytest.param(V4_EP, {"ep": 2, "cp": 2, "tp": 2}, AxisType.Auto, DEFAULT_RULES,
                 marks=pytest.mark.slow),
    pytest.param(V4_EP, {"dp": 2, "cp": 2}, AxisType.Explicit, FOLD_DP, marks=pytest.mark.slow),
    pytest.param(GLM, {"dp": 2, "cp": 2, "tp": 2}, AxisType.Explicit, FOLD_DP_CP,
                 marks=pytest.mark.slow),
], ids=["glm-ep2cp2tp2", "v4-dp2ep4", "glm-ep8-auto", "v4-ep8", "v4-ep2cp2tp2-auto",
        "v4-experts-on-dp2", "glm-experts-on-dp2cp2"])
def test_models_on_ep_meshes_equal_one_device(case, sizes, kind, rules):
    """Logits, LM and indexer losses and every gradient (the experts' included) equal one
    device; the compiled step moves pairs by all-to-all and never gathers expert weights; each
    device holds E / ep experts of every MoE layer, and their gradients stay split. The last
    two fold ep over dp (and cp) by the rules, without an ep axis."""
    preset, overrides = case
    graphdef, params, rest, logical, (ids, pos, seg) = model_and_batch(preset, **dict(overrides))
    want = step(graphdef, "sparse")(params, rest, ids, pos, seg, targets_of(ids))
    f = step.__wrapped__(graphdef, "sparse")  # a fresh jit: each rule table traces its own
    mesh = make_mesh(sizes, kind)
    with jax.set_mesh(mesh), axis_rules(rules):
        p, _, _ = place(mesh, params, logical, ())
        tokens = NamedSharding(mesh, logical_to_spec(("batch", "sequence"), mesh=mesh,
                                                     shape=ids.shape))  # batch 2: dp, not ep
        batch = [jax.device_put(a, tokens) for a in (ids, pos, seg, targets_of(ids))]
        compiled = f.lower(p, rest, *batch).compile()
        got = compiled(p, rest, *batch)
        axes = logical_to_spec(("experts",), mesh=mesh)[0]
    ep = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    check(got, want)
    ops = collectives(compiled.as_text())
    assert any(op == "all-to-all" for op, _ in ops), ops
    gathered = [s for op, shapes in ops if op == "all-gather" for s in shapes
                if len(s) == 3 and s[0] in (E, E // ep)]
    assert not gathered, gathered
    for name in ("gate_proj", "up_proj", "down_proj"):
        for tree in (p, got[1]):  # parameters and their gradients: 1/ep on every device
            arr = tree["layers"][1]["mlp"]["experts"][name]
            shard = arr.addressable_shards[0].data
            assert shard.shape[0] == E // ep, (name, shard.shape)
    experts = p["layers"][1]["mlp"]["experts"]
    per_device = sum(x.addressable_shards[0].data.nbytes for x in experts.values())
    total = sum(x.nbytes for x in experts.values())
    assert per_device * ep * sizes.get("tp", 1) == total, (per_device, total)  # tp: inner dim


def test_load_hf_onto_an_ep_mesh_streams_each_devices_experts(tmp_path, monkeypatch):
    """A sharded checkpoint (16 experts a layer, one tensor per expert) loaded onto ep=4: each
    device's callback reads its own 4 experts (every expert tensor read once: no host holds a
    layer's experts), the values and the logits equal the one-device load, and saving the ep
    model writes the same tensors back."""
    from jax_dsa.interop import load_hf, save_hf
    from jax_dsa.interop.reading import CheckpointSource
    from test_interop import _flat, _model, _tiny

    files = save_hf(_model(_tiny(n_routed_experts=E)), tmp_path / "ckpt", max_shard_size="20KB")
    assert len([f for f in files if str(f).endswith(".safetensors")]) > 1  # a sharded checkpoint
    plain = load_hf(tmp_path / "ckpt", dtype=jnp.float32)
    reads = []
    read = CheckpointSource.read
    monkeypatch.setattr(CheckpointSource, "read",
                        lambda self, key, index: reads.append(key) or read(self, key, index))
    mesh = make_mesh({"ep": 4})
    sharded = load_hf(tmp_path / "ckpt", dtype=jnp.float32, mesh=mesh)
    expert_reads = [k for k in reads if ".mlp.experts." in k]
    assert expert_reads and len(expert_reads) == len(set(expert_reads))  # each one, once
    ref = _flat(plain)
    for path, var in nnx.to_flat_state(nnx.state(sharded)):
        x = var.get_value()
        np.testing.assert_array_equal(np.asarray(x), ref[path], err_msg=str(path))
        if "experts" in path and path[-1] != "experts":
            assert x.sharding.spec[0] == "ep" and x.addressable_shards[0].data.shape[0] == E // 4
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    want = jax.jit(lambda m, ids: m(ids)[0])(plain, ids)
    with jax.set_mesh(mesh):
        got = jax.jit(lambda m, ids: m(ids)[0])(sharded, ids)
    assert_close(got, want, what="logits")
    save_hf(sharded, tmp_path / "again")
    again = _flat(load_hf(tmp_path / "again", dtype=jnp.float32))
    for path, x in ref.items():
        np.testing.assert_array_equal(again[path], x, err_msg=str(path))


@pytest.mark.parametrize("factor", [None, 0.5])
def test_poisoned_token_and_no_tokens_on_ep(factor):
    """On ep=4 x dp=2 (capacity exchange): a NaN token poisons its own output row only (the
    buffers' padding and dropped pairs never carry it to other rows), with a cap too; a batch of
    no tokens gives an empty output, no load and no overflow."""
    graphdef, state, x, w, idx = experts_case()
    x = x.copy()
    x[5] = np.nan
    want = experts_step(graphdef)(state, x, w, idx)[0][0]
    model = nnx.merge(graphdef, state)
    set_expert_dispatch(model, "capacity", factor)
    capped, state = nnx.split(model)
    mesh = make_mesh({"dp": 2, "ep": 4}, AxisType.Explicit)
    with jax.set_mesh(mesh):
        placed, args = place_experts(mesh, state, x, w, idx)
        (y, _, overflow), _ = experts_step(capped)(placed, *args)
        y = np.asarray(y)
        np.testing.assert_array_equal(~np.isfinite(y).all(1), np.arange(T) == 5)
        if factor is None:
            assert int(overflow) == 0
            np.testing.assert_allclose(np.delete(y, 5, 0), np.delete(np.asarray(want), 5, 0),
                                       rtol=1e-5, atol=1e-5)
        placed, args = place_experts(mesh, state, x[:0], w[:0], idx[:0])
        (y, load, overflow), _ = experts_step(capped)(placed, *args)
    assert y.shape == (0, x.shape[1]) and int(load.sum()) == 0 and int(overflow) == 0


@pytest.mark.gpu
def test_ragged_dispatch_on_gpus_equals_one_device():
    """The ``"ragged"`` exchange (``jax.lax.ragged_all_to_all``; XLA:CPU has none) on every GPU
    there is (ep = the largest power of two <= min(GPU count, 8); one GPU: a group of one,
    the collective's lowering and transpose still run): outputs, loads and every gradient
    equal one device, and the compiled program holds the ragged all-to-all."""
    graphdef, state, x, w, idx = experts_case()
    want = experts_step(graphdef)(state, x, w, idx)
    n = 1
    while n * 2 <= min(jax.device_count(), 8):
        n *= 2
    model = nnx.merge(graphdef, state)
    set_expert_dispatch(model, "ragged")
    ragged, state = nnx.split(model)
    mesh = make_mesh({"ep": n}, AxisType.Explicit)
    with jax.set_mesh(mesh):
        placed, args = place_experts(mesh, state, x, w, idx)
        compiled = experts_step(ragged).lower(placed, *args).compile()
        got = compiled(placed, *args)
    compare(got, want, f"ragged ep={n}")
    assert int(got[0][2]) == 0
    assert "ragged-all-to-all" in compiled.as_text() or "ragged_all_to_all" in compiled.as_text()
