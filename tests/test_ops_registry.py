"""jax_dsa.ops.registry on toy implementations, and the ``implementation=`` argument of the ops
and layers that use it (names, fallback chains, errors, pass-through from the layers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dsa import _native, sparse_mla
from jax_dsa.models.glm.attention import DSAAttention
from jax_dsa.models.glm.model import DSALanguageModel
from jax_dsa.ops import sparse_mla as sparse_mla_module
from jax_dsa.ops.indexer import indexer_kl_loss, indexer_topk
from jax_dsa.ops.registry import (
    Implementation,
    Registry,
    Unavailable,
    always,
    native_unavailable,
)
from jax_dsa.ops.sparse_mla.config import Call
from test_models_glm_attention import small_config

# ------------------------------------------------------------------------------------------
# The registry on toy implementations. A call is a dict; each implementation refuses the calls
# whose "refuse" set names it, with the reason "<name> refuses".


def toy(name, unavailable=False):
    def supported(call):
        if unavailable:
            return Unavailable(f"{name} is not built")
        return f"{name} refuses" if name in call.get("refuse", ()) else None

    return Implementation(name, supported, forward=lambda *a: name)


def toy_registry(**preference):
    preference = preference or {"cpu": ("b", "a"), "gpu": ("c", "a"), "default": ("a",)}
    return Registry("toy_op", (toy("a"), toy("b"), toy("c"), toy("gone", unavailable=True)),
                    preference)


def test_a_name_picks_that_implementation():
    reg = toy_registry()
    for name in ("a", "b", "c"):
        impl = reg.choose(name, {})
        assert impl is reg[name] and impl.name == name and impl.forward() == name
    assert reg.names == ("a", "b", "c", "gone")
    assert "b" in reg and "z" not in reg
    assert repr(reg["a"]) == "Implementation('a')"


def test_a_name_that_refuses_raises_its_reason():
    reg = toy_registry()
    with pytest.raises(ValueError, match=r"^toy_op: b refuses$"):
        reg.choose("b", {"refuse": {"b"}})
    with pytest.raises(NotImplementedError, match=r"^toy_op: gone is not built$"):
        reg.choose("gone", {})


def test_a_sequence_picks_the_first_that_supports_the_call():
    reg = toy_registry()
    assert reg.choose(("b", "a"), {}).name == "b"
    assert reg.choose(("b", "a"), {"refuse": {"b"}}).name == "a"
    assert reg.choose(["c", "b", "a"], {"refuse": {"c", "b"}}).name == "a"
    assert reg.choose(("gone", "c"), {}).name == "c"  # an unavailable one is skipped
    assert reg.candidates(["c", "a"]) == ("c", "a")


def test_none_follows_the_platform_preference(monkeypatch):
    reg = toy_registry()
    assert reg.preference("cpu") == ("b", "a")
    assert reg.preference("gpu") == ("c", "a")
    assert reg.preference("tpu") == ("a",)  # no entry: the default one
    assert reg.preference() == reg.preference(jax.default_backend())
    assert reg.candidates(None) == reg.preference()
    assert reg.choose(None, {}).name == reg.preference()[0]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert reg.candidates(None) == ("c", "a")
    assert reg.choose(None, {}).name == "c"
    assert reg.choose(None, {"refuse": {"c"}}).name == "a"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert reg.choose(None, {}).name == "a"


@pytest.mark.parametrize("bad", ["z", ("a", "z"), (), [], ("a", 3), 3, b"a", {"a": 1}])
def test_unknown_names_raise_value_error_naming_implementation(bad):
    reg = toy_registry()
    with pytest.raises(ValueError, match="toy_op: implementation must be one of") as e:
        reg.choose(bad, {})
    assert "('a', 'b', 'c', 'gone')" in str(e.value) and repr(bad) in str(e.value)
    with pytest.raises(ValueError, match="implementation"):
        reg.candidates(bad)


def test_no_supporting_implementation_lists_every_reason():
    reg = toy_registry()
    with pytest.raises(ValueError) as e:
        reg.choose(("a", "b", "gone"), {"refuse": {"a", "b"}})
    msg = str(e.value)
    assert msg.startswith("toy_op: no implementation of ('a', 'b', 'gone') supports this call")
    for part in ("'a': a refuses", "'b': b refuses", "'gone': gone is not built"):
        assert part in msg, msg
    # None: the platform's preference, every one refusing.
    with pytest.raises(ValueError, match="b refuses.*a refuses"):
        toy_registry(cpu=("b", "a"), default=("b", "a")).choose(None, {"refuse": {"a", "b"}})


def test_all_unavailable_raises_not_implemented_error():
    reg = Registry("toy_op", (toy("x", unavailable=True), toy("y", unavailable=True)),
                   {"default": ("x", "y")})
    with pytest.raises(NotImplementedError, match="'x': x is not built; 'y': y is not built"):
        reg.choose(None, {})
    with pytest.raises(NotImplementedError):
        reg.choose(("y", "x"), {})
    # One unavailable, one refusing: a ValueError (the call itself is not supported).
    with pytest.raises(ValueError):
        toy_registry().choose(("gone", "a"), {"refuse": {"a"}})


def test_restrict_keeps_the_names_the_op_has(monkeypatch):
    reg = toy_registry()
    assert reg.restrict(None) is None
    # The op's own names first, in order, then its default order for the platform (cpu here).
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert reg.restrict("b") == ("b", "a")
    assert reg.restrict("cpu") is None  # a name of another op: this op's default order
    assert reg.restrict(("cpu", "b")) == ("b", "a")
    assert reg.restrict(("c", "cpu", "a")) == ("c", "a", "b")
    assert reg.restrict(["a", "c"]) == ("a", "c", "b")
    assert reg.restrict(("cpu", "cuda")) is None
    # What restrict returns is always a valid `implementation=` for the op.
    for impl in (None, "b", "cpu", ("cpu", "b"), ("c", "cpu", "a"), ("cpu", "cuda")):
        reg.candidates(reg.restrict(impl))



@pytest.mark.parametrize("bad", [5, "", [], ("a", 3), ("a", "")])
def test_restrict_refuses_what_is_no_name_or_sequence_of_names(bad):
    with pytest.raises(ValueError, match="implementation must be None, a name or a non-empty"):
        toy_registry().restrict(bad)


@pytest.mark.parametrize("bad", ["xlaa", ("cuda", "xlaa")])
def test_restrict_refuses_a_name_no_op_has(bad):
    with pytest.raises(ValueError, match=r"\['xlaa'\] is not an implementation of any op"):
        toy_registry().restrict(bad)


def test_registry_construction_is_checked():
    with pytest.raises(ValueError, match="share a name"):
        Registry("toy_op", (toy("a"), toy("a")), {"default": ("a",)})
    with pytest.raises(ValueError, match="unknown implementation 'z'"):
        Registry("toy_op", (toy("a"),), {"default": ("a",), "cpu": ("z",)})
    with pytest.raises(ValueError, match="'default'"):
        Registry("toy_op", (toy("a"),), {"cpu": ("a",)})


def test_always_and_native_unavailable():
    assert always(object()) is None
    for name, module in (("cpu", "_cpu"), ("cuda", "_cuda")):
        why = native_unavailable(name, module)
        if name in _native.available():
            assert why is None
        else:
            assert isinstance(why, Unavailable) and f"implementation={name!r}" in why
    why = native_unavailable("nope", "_nope")
    assert isinstance(why, Unavailable) and isinstance(why, str)
    assert "implementation='nope' is not available" in why and "not built" in why
    assert "jax_dsa._nope" in why  # names the module that did not load


# ------------------------------------------------------------------------------------------
# The ops


def _mla_inputs(d_qk=16, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 5, 3, d_qk)), dtype)
    kv = jnp.asarray(rng.standard_normal((2, 7, d_qk)), dtype)
    idx = jnp.asarray(rng.integers(-1, 7, (2, 5, 4)), jnp.int32)
    return q, kv, idx


def test_sparse_mla_cuda_then_xla_falls_back_to_xla():
    """float32 at the kernels' widths: "cuda" refuses (the bfloat16 rule, or it is not built);
    "xla" runs, with the same values and gradients as implementation="xla"."""
    q, kv, idx = _mla_inputs(576)
    sink = jnp.asarray([0.3, -1.0, 2.0], jnp.float32)

    def value_and_grads(implementation):
        def f(q, kv, sink):
            out, lse = sparse_mla(q, kv, idx, sm_scale=576**-0.5, d_v=512, attn_sink=sink,
                                  implementation=implementation)
            return jnp.sum(jnp.sin(out)), (out, lse)

        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(
            q, kv, sink)
        return (out, lse) + grads

    want = value_and_grads("xla")
    for a, b in zip(value_and_grads(("cuda", "xla")), want):
        np.testing.assert_array_equal(a, b)
    # The choice itself, for other calls "cuda" refuses (a list works as a tuple does).
    reg = sparse_mla_module.REGISTRY
    for dtype, d_qk, d_v in ((jnp.float32, 576, 512), (jnp.float32, 16, 8), (jnp.bfloat16, 16, 8),
                             (jnp.bfloat16, 576, 64)):
        call = Call(jnp.dtype(dtype), 3, d_qk, d_v, 4)
        for impl in (("cuda", "xla"), ["cuda", "xla"]):
            assert reg.choose(impl, call) is reg["xla"], (dtype, d_qk, d_v)


def test_sparse_mla_cuda_alone_on_float32_raises_the_rule():
    q, kv, idx = _mla_inputs(576)
    if "cuda" in sparse_mla_module.AVAILABLE:
        exc, match = ValueError, "implementation='cuda' needs bfloat16 q and kv, got float32"
    else:
        exc, match = NotImplementedError, "implementation='cuda' is not available"
    for impl in ("cuda", ("cuda",)):
        with pytest.raises(exc, match=match):
            sparse_mla(q, kv, idx, sm_scale=0.1, d_v=512, implementation=impl)
    # The D_qk rule is told first, whether or not "cuda" is built.
    q, kv, idx = _mla_inputs(16)
    with pytest.raises(ValueError, match=r"supports D_qk in \(512, 576\), got 16"):
        sparse_mla(q, kv, idx, sm_scale=0.1, d_v=8, implementation=("cuda",))


@pytest.mark.parametrize("bad", ["tpu", ("cuda", "tpu"), (), "CPU"])
def test_sparse_mla_unknown_implementation(bad):
    q, kv, idx = _mla_inputs()
    with pytest.raises(ValueError, match="sparse_mla: implementation must be one of"):
        sparse_mla(q, kv, idx, sm_scale=0.1, d_v=8, implementation=bad)


def _index_inputs():
    rng = np.random.default_rng(1)
    s = 12
    iq = jnp.asarray(rng.standard_normal((s, 2, 8)), jnp.float32)
    ik = jnp.asarray(rng.standard_normal((s, 8)), jnp.float32)
    iw = jnp.asarray(rng.standard_normal((s, 2)), jnp.float32)
    return iq, ik, iw, np.arange(s)


def test_indexer_topk_implementation():
    iq, ik, iw, pos = _index_inputs()
    kw = dict(topk=4, q_positions=pos, kv_positions=pos)
    want = indexer_topk(iq, ik, iw, **kw)
    for impl in ("xla", ("xla",), ["xla"]):
        np.testing.assert_array_equal(indexer_topk(iq, ik, iw, implementation=impl, **kw), want)
    for bad in ("cpu", ("cpu",), ("cpu", "xla")):  # "cpu" is sparse_mla's alone
        with pytest.raises(ValueError, match="indexer_topk: implementation must be one of"):
            indexer_topk(iq, ik, iw, implementation=bad, **kw)


def test_indexer_kl_loss_implementation():
    iq, ik, iw, pos = _index_inputs()
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((pos.size, 3, 4)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((pos.size, 4)), jnp.float32)
    kw = dict(sm_scale=0.5, q_positions=pos, kv_positions=pos)
    want = indexer_kl_loss(iq, ik, iw, q, kv, **kw)
    np.testing.assert_array_equal(indexer_kl_loss(iq, ik, iw, q, kv, implementation=("xla",),
                                                  **kw), want)
    with pytest.raises(ValueError, match="indexer_kl_loss: implementation must be one of"):
        indexer_kl_loss(iq, ik, iw, q, kv, implementation="cpu", **kw)


# ------------------------------------------------------------------------------------------
# The layers pass `implementation` on: sparse_mla takes "cpu"; the indexer ops, which lack it,
# get what their registries keep of it (their default order when nothing is left).

needs_cpu = pytest.mark.skipif("cpu" not in sparse_mla_module.AVAILABLE,
                               reason=f"cpu module not built: {_native.LOAD_ERRORS.get('_cpu')}")
CPU_TARGET = "jax_dsa_sparse_mla_fwd_cpu"


def abstract_split(make):
    """``nnx.split`` of the module ``make()`` builds, built abstractly (no init compiles)."""
    return nnx.split(nnx.eval_shape(make))


def random_state(state, seed):
    """O(1)-effect random parameters from NumPy (norm weights near 1), as tests/
    test_models_glm_attention.py's ``randomize``, without running the initialisers."""
    rng = np.random.default_rng(seed)

    def leaf(s):
        if len(s.shape) == 1:
            return jnp.asarray(1 + 0.3 * rng.standard_normal(s.shape), s.dtype)
        return jnp.asarray(rng.standard_normal(s.shape) * s.shape[-1] ** -0.5, s.dtype)

    return jax.tree.map(leaf, state)


@needs_cpu
def test_attention_layer_passes_implementation_through():
    """implementation="cpu" and ("cpu", "xla") both run sparse_mla's host handlers, and the
    indexer ops (which lack "cpu") their "xla" one: one computation, the same jaxpr."""
    c = small_config("glm5")
    graphdef, state = abstract_split(lambda: DSAAttention(c, 0, rngs=nnx.Rngs(0)))
    layer = nnx.merge(graphdef, random_state(state, 3))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 10, c.hidden_size)),
                    jnp.float32)

    def jaxpr(implementation):
        return str(jax.make_jaxpr(lambda x: layer(x, implementation=implementation))(x))

    assert CPU_TARGET not in jaxpr("xla")
    on_cpu = jaxpr("cpu")
    assert CPU_TARGET in on_cpu  # sparse_mla runs the host handlers
    assert jaxpr(("cpu", "xla")) == on_cpu
    out, aux = nnx.jit(lambda m, x: m(x, implementation="cpu"))(layer, x)
    assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))
    assert aux["indices"].shape == (2, 10, c.index_topk) and float(aux["indexer_loss"]) > 0


@needs_cpu
def test_language_model_passes_implementation_through():
    """Every layer of the model gets the implementation, and no op refuses the names: traced on
    abstract parameters (no compile), sparse_mla runs the host handlers once per layer in sparse
    mode; dense mode runs dense_mla, which has no "cpu" implementation and falls back to "xla"."""
    c = small_config("glm5", num_hidden_layers=2)
    graphdef, state = abstract_split(lambda: DSALanguageModel(c, rngs=nnx.Rngs(0)))
    ids = jax.ShapeDtypeStruct((2, 12), jnp.int32)
    for impl in ("cpu", ("cpu", "xla")):
        for mode in ("sparse", "dense"):
            text = str(jax.make_jaxpr(lambda state, ids: nnx.merge(graphdef, state)(
                ids, attention_mode=mode, implementation=impl))(state, ids))
            want = c.num_hidden_layers if mode == "sparse" else 0
            assert text.count(CPU_TARGET) == want, (impl, mode)


def test_a_sequence_skips_implementations_for_other_platforms(monkeypatch):
    """("cuda", "xla") on a host runs "xla" even for a call "cuda" supports; "cuda" alone is
    still chosen (to lower for a GPU on a host)."""
    gpu_only = Implementation("cuda", always, lambda: "cuda", platforms=("gpu",))
    anywhere = Implementation("xla", always, lambda: "xla")
    reg = Registry("op", (anywhere, gpu_only), preference={"default": ("xla",)})
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert reg.choose(("cuda", "xla"), None) is anywhere
    assert reg.choose("cuda", None) is gpu_only
    with pytest.raises(ValueError, match="default backend is 'cpu'"):
        reg.choose(("cuda",), None)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert reg.choose(("cuda", "xla"), None) is gpu_only
