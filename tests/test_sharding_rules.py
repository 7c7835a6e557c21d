"""Logical axis rules (jax_dsa.sharding.rules) and the activation-constraint helper
(jax_dsa.sharding.constraints) on Auto, Explicit and Manual meshes of CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsa.sharding import DEFAULT_RULES, axis_rules, constrain, current_rules, logical_to_spec
from jax_dsa.sharding.constraints import check_split, explicit_axes, out_spec, typed_spec
from meshes import make_mesh


def test_default_rules_map_the_model_axes():
    table = dict(DEFAULT_RULES)
    assert (table["batch"], table["sequence"], table["heads"]) == (("dp", "ep"), "cp", "tp")
    assert table["experts"] == "ep"  # the ep devices are data parallel for the rest
    assert table["index_heads"] is None  # duplicated indexer: identical top-k on head shards
    assert logical_to_spec(("batch", "sequence", "heads", None)) == P(("dp", "ep"), "cp", "tp", None)
    assert logical_to_spec(("embed", "vocab")) == P(None, "tp")


def test_logical_to_spec_skips_missing_axes_indivisible_dims_and_reuse():
    mesh = make_mesh({"dp": 2, "tp": 4})
    assert logical_to_spec(("batch", "sequence"), mesh=mesh) == P("dp", None)  # no cp axis
    assert logical_to_spec(("heads", "q_lora"), mesh=mesh, shape=(6, 8)) == P(None, None)
    assert logical_to_spec(("heads", "q_lora"), mesh=mesh, shape=(8, 8)) == P("tp", None)
    assert logical_to_spec(("heads", "mlp"), mesh=mesh) == P("tp", None)  # tp used once
    rules = (("batch", ("dp", "tp")),)
    assert logical_to_spec(("batch",), rules, mesh, (16,)) == P(("dp", "tp"))
    # a rule's missing axes are left out; a dim takes the longest leading part that divides it
    assert logical_to_spec(("batch",), mesh=mesh, shape=(4,)) == P("dp")  # no ep axis
    ep = make_mesh({"dp": 2, "ep": 4})
    # a mesh axis once per array: the first dim that claims it wins
    assert logical_to_spec(("batch", "experts"), mesh=ep, shape=(8, 16)) == P(("dp", "ep"), None)
    assert logical_to_spec(("batch",), mesh=ep, shape=(8,)) == P(("dp", "ep"))
    assert logical_to_spec(("batch",), mesh=ep, shape=(2,)) == P("dp")
    assert logical_to_spec(("batch",), mesh=ep, shape=(3,)) == P(None)
    assert logical_to_spec(("experts", "mlp"), mesh=ep, shape=(16, 8)) == P("ep", None)
    with pytest.raises(ValueError, match="axis names for shape"):
        logical_to_spec(("batch",), shape=(2, 3))


def test_axis_rules_context_overrides_the_default():
    assert current_rules() == DEFAULT_RULES
    with axis_rules((("sequence", None), ("batch", "dp"))):
        assert logical_to_spec(("batch", "sequence")) == P("dp", None)
    assert current_rules() == DEFAULT_RULES


def test_constrain_on_auto_explicit_and_manual_meshes():
    x = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4, 8, 3)
    names = ("batch", "sequence", None)
    assert constrain(x, names) is x  # no mesh: nothing to do
    with pytest.raises(ValueError, match="axis names"):
        constrain(x, ("batch",))

    f = jax.jit(lambda x: constrain(x * 2, names))
    mesh = make_mesh({"dp": 2, "cp": 2})
    with jax.set_mesh(mesh):
        y = f(x)  # replicated input: the constraint splits the result
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "cp", None)), 3)
    np.testing.assert_array_equal(y, 2 * x)

    explicit = make_mesh({"dp": 2, "cp": 2}, AxisType.Explicit)
    with jax.set_mesh(explicit):
        y = jax.jit(lambda x: constrain(x * 2, names))(x)
        assert jax.typeof(y).sharding.spec == P("dp", "cp", None)  # part of the type
        with axis_rules((("batch", "dp"),)):
            y = jax.jit(lambda x: constrain(x + 1, names))(x)
            assert jax.typeof(y).sharding.spec == P("dp", None, None)
    np.testing.assert_array_equal(y, x + 1)

    def body(x):  # inside shard_map: the local block is left alone
        return constrain(x, names) + 1

    y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))(x)
    np.testing.assert_array_equal(y, x + 1)
    assert jnp.asarray(y).shape == x.shape


def test_out_spec_and_explicit_axes():
    assert out_spec(("dp", "cp"), "tp") == P("dp", "cp", "tp")
    assert out_spec(("dp", "tp"), "tp") == P("dp", "tp", None)  # tp already used: dropped
    assert out_spec(("dp",), ("cp", "tp"), "tp") == P("dp", ("cp", "tp"), None)
    assert out_spec((None,), None) == P(None, None)
    assert explicit_axes() == frozenset()  # no mesh
    with jax.set_mesh(make_mesh({"dp": 2, "cp": 2})):
        assert explicit_axes() == frozenset()
    mixed = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit, AxisType.Auto),
                          devices=jax.devices()[:4])
    with jax.set_mesh(mixed):
        assert explicit_axes() == frozenset({"dp"})
        x = jax.device_put(np.ones((4, 6), np.float32), P("dp", None))
        assert typed_spec(x) == ("dp", None)


def test_check_split_names_the_count_the_axes_and_the_rule():
    check_split(3, "heads", "num_attention_heads")  # no mesh: nothing to check
    with jax.set_mesh(make_mesh({"dp": 2, "tp": 4})):
        check_split(8, "heads", "num_attention_heads")
        check_split(3, "index_heads", "index_n_heads")  # mapped to None by default
        with pytest.raises(ValueError, match=r"num_attention_heads = 6 does not split over mesh "
                           r"axes \('tp',\) \(size 4\).*map 'heads' to None"):
            check_split(6, "heads", "num_attention_heads")
        with axis_rules((("index_heads", ("dp", "tp")),)):
            with pytest.raises(ValueError, match=r"index_n_heads = 4 .*\('dp', 'tp'\) \(size 8\)"):
                check_split(4, "index_heads", "index_n_heads")

        with pytest.raises(ValueError, match="num_attention_heads = 6"):
            check_split(6, "heads", "num_attention_heads", axis_types=(AxisType.Auto,))
        check_split(6, "heads", "num_attention_heads", axis_types=(AxisType.Explicit,))

    def body(x):  # inside shard_map (even over some axes only) constrain does nothing: no check
        check_split(6, "heads", "num_attention_heads")
        return x

    mesh = make_mesh({"tp": 4})
    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(np.zeros(8))
    mesh = make_mesh({"dp": 2, "tp": 4})
    with jax.set_mesh(mesh):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
                              axis_names={"dp"}))(np.zeros(8))
