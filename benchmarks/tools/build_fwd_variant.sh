#!/usr/bin/env bash
# Builds one variant of the SM90 sparse MLA forward as a standalone shared library that holds only
# the forward's raw bench entry (ffi/cuda/bench/sparse_mla_fwd_bench.cc; no nanobind module, no
# backward), for same-process comparisons on a GPU machine with
# benchmarks/tools/sparse_mla_fwd_variants.py.
# The variants (heads, D_qk) are the checkout's jax_dsa/kernel_spec.py. No GPU is needed; 30-60 s
# on two cores.
#
#   benchmarks/tools/build_fwd_variant.sh NAME [KERNEL_SOURCE]
#
# KERNEL_SOURCE: a copy of ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py with the change to measure
# (default: the checkout's own). Writes build/fwd_variants/NAME/libfwd.so and md5.txt (checksums of
# the exported objects and of their device code: equal cubin checksums mean the same device code; the
# launch settings live in the host code). Needs the set-up's
# .venv with the CUDA build requirements (scripts/setup.sh with nvcc on PATH).
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
name=$1
case $name in
  "" | .* | */* | matmul) echo "build_fwd_variant: NAME '$name' must be a plain file name (not matmul)" >&2
                          exit 2 ;;
esac
root=$(cd "$(dirname "$0")/../.." && pwd)
src=${2:-$root/ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py}
[ -f "$src" ] || { echo "build_fwd_variant: no kernel source $src" >&2; exit 2; }
src=$(realpath "$src")
py=$root/.venv/bin/python
[ -x "$py" ] || { echo "build_fwd_variant: run scripts/setup.sh first (no .venv)" >&2; exit 1; }
# the CUDA toolkit: CUDA_HOME, else the folder above nvcc's, else /usr/local/cuda
cuda_home=${CUDA_HOME:-}
for cand in "$cuda_home" "$(dirname "$(dirname "$(command -v nvcc || echo /x/x/x)")")" /usr/local/cuda; do
  if [ -n "$cand" ] && [ -f "$cand/include/cuda_runtime.h" ]; then cuda_home=$cand; break; fi
done
[ -f "$cuda_home/include/cuda_runtime.h" ] ||
  { echo "build_fwd_variant: no CUDA toolkit found (set CUDA_HOME)" >&2; exit 1; }
site=$("$py" -c 'import jaxlib, os; print(os.path.dirname(os.path.dirname(jaxlib.__file__)))')
dsl_runtime=$site/nvidia_cutlass_dsl/cu13/lib/libcuda_dialect_runtime_static.a
out=$root/build/fwd_variants/$name
gen=$out/gen
rm -rf "$out"
mkdir -p "$gen/src/ffi/cuda/export" "$gen/src/ffi/cuda/sparse_mla_fwd" "$gen/src/jax_dsa" "$gen/obj"
# The export script imports the kernel module from ../sparse_mla_fwd and reads the variants from
# jax_dsa/kernel_spec.py three folders up: the copy keeps the checkout's layout.
cp "$root/ffi/cuda/export/export_sparse_mla_fwd.py" "$root/ffi/cuda/export/kernel_spec_loader.py" \
  "$gen/src/ffi/cuda/export/"
cp "$src" "$gen/src/ffi/cuda/sparse_mla_fwd/sparse_mla_fwd_sm90.py"
cp "$root/jax_dsa/kernel_spec.py" "$gen/src/jax_dsa/"
"$py" "$gen/src/ffi/cuda/export/export_sparse_mla_fwd.py" --out-dir "$gen/obj" --jobs 2 \
  >"$gen/export.log" 2>&1 || { tail -30 "$gen/export.log" >&2; exit 1; }
g++ -O2 -std=c++17 -fPIC -shared -o "$out/libfwd.so" \
  -I "$root/ffi" -I "$gen/obj" -isystem "$cuda_home/include" \
  "$root/ffi/cuda/bench/sparse_mla_fwd_bench.cc" "$root/ffi/cuda/sparse_mla_fwd/launch.cc" \
  "$gen/obj/sparse_mla_fwd_variants.cc" "$gen/obj"/*.o \
  "$dsl_runtime" "$cuda_home/lib64/libcudart_static.a" -lpthread -ldl -lrt
# Checksums of each object and of the cubin (CUDA ELF image) it embeds. The objects also hold host
# code that the DSL compiles for the build machine's CPU, so whole-object checksums are comparable
# only between builds on one machine; the cubins' are the device code wherever it was built.
"$py" - "$gen/obj" >"$out/md5.txt" <<'PY'
import glob, hashlib, os, struct, sys
for obj in sorted(glob.glob(os.path.join(sys.argv[1], "*.o"))):
    data = open(obj, "rb").read()
    i = data.find(b"\x7fELF", 1)  # the object's own header is at 0
    assert i > 0 and data.find(b"\x7fELF", i + 1) < 0, f"{obj}: not one embedded ELF image"
    # ELF64, little-endian, EM_CUDA
    assert data[i + 4] == 2 and data[i + 5] == 1 and struct.unpack_from("<H", data, i + 0x12)[0] == 190, obj
    phoff, shoff = struct.unpack_from("<QQ", data, i + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for k in range(shnum):  # and every section's bytes (SHT_NOBITS = 8 has none)
        sh_type, = struct.unpack_from("<I", data, i + shoff + k * shentsize + 4)
        off, size = struct.unpack_from("<QQ", data, i + shoff + k * shentsize + 0x18)
        if sh_type != 8:
            end = max(end, off + size)
    assert i + end <= len(data), obj
    name = os.path.basename(obj)
    print(hashlib.md5(data).hexdigest(), name)
    print(hashlib.md5(data[i:i + end]).hexdigest(), name + ":cubin")
PY
rm -rf "$gen"
echo "build_fwd_variant: $out/libfwd.so"
cat "$out/md5.txt"
