"""jax_dsa/kernel_spec.py, the one list of the CUDA kernels' variants: loadable by the build without
jax, read by the export scripts, and equal to what a built ``_cuda`` module holds."""

import ast
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from jax_dsa import _native, kernel_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPEC = ROOT / "jax_dsa" / "kernel_spec.py"
EXPORTS = ROOT / "ffi" / "cuda" / "export"
FWD_KERNEL = ROOT / "ffi" / "cuda" / "sparse_mla_fwd" / "sparse_mla_fwd_sm90.py"
NAMES = ("SPARSE_MLA_HEADS", "SPARSE_MLA_D_QK", "SPARSE_MLA_D_V", "SPARSE_MLA_FWD_K_MULTIPLE",
         "DSA_BWD_SLOT_BUCKETS", "DSA_BWD_SM100_SLOT_BUCKETS")


def test_imports_only_the_standard_library():
    tree = ast.parse(SPEC.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        for r in roots:
            assert r in sys.stdlib_module_names, f"kernel_spec.py imports {r}"


def test_values_are_well_formed():
    for name in ("SPARSE_MLA_HEADS", "SPARSE_MLA_D_QK", "DSA_BWD_SLOT_BUCKETS",
                 "DSA_BWD_SM100_SLOT_BUCKETS"):
        v = getattr(kernel_spec, name)
        assert isinstance(v, tuple) and v and all(type(x) is int and x > 0 for x in v), name
        assert list(v) == sorted(set(v)), f"{name} must be ascending without repeats"
    # The kernels work on 64-head tiles and take d_v from the front of each key row.
    assert all(h % 64 == 0 for h in kernel_spec.SPARSE_MLA_HEADS)
    assert kernel_spec.SPARSE_MLA_D_V <= min(kernel_spec.SPARSE_MLA_D_QK)
    assert set(kernel_spec.DSA_BWD_SM100_SLOT_BUCKETS) <= set(kernel_spec.DSA_BWD_SLOT_BUCKETS)
    # The glue pads K to the forward's multiple, then to a bucket: every bucket must be one.
    assert all(k % kernel_spec.SPARSE_MLA_FWD_K_MULTIPLE == 0
               for k in kernel_spec.DSA_BWD_SLOT_BUCKETS)


def _bare_python(*args):
    """Runs Python isolated and without site-packages (no jax, no CuTe DSL), as the build may;
    -B: no bytecode in ffi/ (scripts/setup.sh would take it for a changed build input)."""
    return subprocess.run([sys.executable, "-I", "-S", "-B", *args], capture_output=True,
                          text=True, check=True, cwd=ROOT).stdout


def test_the_build_loads_it_without_jax():
    code = ("import importlib.util, json, sys\n"
            f"s = importlib.util.spec_from_file_location('ks', {str(SPEC)!r})\n"
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            "assert 'jax' not in sys.modules\n"
            f"print(json.dumps({{n: getattr(m, n) for n in {NAMES!r}}}))\n")
    got = json.loads(_bare_python("-c", code))
    assert got == {n: list(v) if isinstance(v, tuple) else v
                   for n, v in ((n, getattr(kernel_spec, n)) for n in NAMES)}


@pytest.mark.parametrize("script", ["export_dsa_bwd.py", "export_sparse_mla_fwd.py",
                                    "export_dsa_bwd_sm100.py"])
def test_export_scripts_read_it(script, tmp_path):
    """Each export step's stamp holds the kernel_spec values its script reads (and stays
    untouched when written again with the same values, so Ninja skips the export)."""
    stamp = tmp_path / "stamp.json"
    _bare_python(str(EXPORTS / script), "--spec-stamp", str(stamp))
    values = json.loads(stamp.read_text())
    assert values and all(v == json.loads(json.dumps(getattr(kernel_spec, n)))
                          for n, v in values.items())
    before = stamp.stat().st_mtime_ns
    _bare_python(str(EXPORTS / script), "--spec-stamp", str(stamp))
    assert stamp.stat().st_mtime_ns == before


def test_export_scripts_list_the_spec_variants():
    ks = kernel_spec
    bwd = _bare_python(str(EXPORTS / "export_dsa_bwd.py"), "--list-outputs").split()
    want = [f"jax_dsa_dsa_bwd_pre_h{h}.o" for h in ks.SPARSE_MLA_HEADS]
    want += [f"jax_dsa_dsa_bwd_post_d{d}.o" for d in ks.SPARSE_MLA_D_QK]
    want += [f"jax_dsa_dsa_bwd_main_h{h}_d{d}_k{k}.o" for h in ks.SPARSE_MLA_HEADS
             for d in ks.SPARSE_MLA_D_QK for k in ks.DSA_BWD_SLOT_BUCKETS + ("any",)]
    assert bwd == want
    fwd = _bare_python(str(EXPORTS / "export_sparse_mla_fwd.py"), "--list-outputs").split()
    assert fwd == [f"jax_dsa_{form}_mla_{mode}_h{h}_d{d}.o"
                   for form, mode in (("sparse", "fwd"), ("dense", "fwd"), ("sparse", "target"))
                   for h in ks.SPARSE_MLA_HEADS for d in ks.SPARSE_MLA_D_QK]
    sm100 = _bare_python(str(EXPORTS / "export_dsa_bwd_sm100.py"), "--list-outputs").split()
    buckets = {int(f.rsplit("_k", 1)[1][:-2]) for f in sm100 if f.endswith(".o")}
    assert buckets == set(ks.DSA_BWD_SM100_SLOT_BUCKETS)


def test_the_forward_kernel_is_written_for_the_spec_d_v():
    # The kernel module needs CuTe DSL to import, so its constant is read from the source.
    tree = ast.parse(FWD_KERNEL.read_text())
    d_v = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
           and [getattr(t, "id", None) for t in n.targets] == ["D_V"]]
    assert d_v == [kernel_spec.SPARSE_MLA_D_V]


def test_built_module_holds_exactly_the_spec_variants():
    if "cuda" not in _native.available():
        pytest.skip(f"CUDA module not built: {_native.LOAD_ERRORS.get('_cuda')}")
    ks = kernel_spec
    got = _native.require("_cuda").compiled_variants()
    fwd, bwd = got["forward"], got["backward"]
    assert [tuple(v) for v in fwd["variants"]] == [(h, d) for h in ks.SPARSE_MLA_HEADS
                                                   for d in ks.SPARSE_MLA_D_QK]
    assert [tuple(v) for v in fwd["dense_variants"]] == [tuple(v) for v in fwd["variants"]]
    assert [tuple(v) for v in fwd["target_variants"]] == [tuple(v) for v in fwd["variants"]]
    assert fwd["d_v"] == ks.SPARSE_MLA_D_V
    assert fwd["k_multiple"] == ks.SPARSE_MLA_FWD_K_MULTIPLE
    assert [tuple(v) for v in bwd["variants"]] == [
        (h, d, k) for h in ks.SPARSE_MLA_HEADS for d in ks.SPARSE_MLA_D_QK
        for k in ks.DSA_BWD_SLOT_BUCKETS + (0,)]  # 0: the wide variant (any K)
    assert list(bwd["pre_heads"]) == list(ks.SPARSE_MLA_HEADS)
    assert list(bwd["post_d_qk"]) == list(ks.SPARSE_MLA_D_QK)
    assert bwd["d_v"] == ks.SPARSE_MLA_D_V


def test_the_build_reads_this_checkouts_file():
    spec = importlib.util.spec_from_file_location("_loader", EXPORTS / "kernel_spec_loader.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    assert pathlib.Path(loader.PATH).resolve() == SPEC
