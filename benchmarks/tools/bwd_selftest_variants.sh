#!/usr/bin/env bash
# Same-call A/B of build variants of the own sparse-MLA backward (ffi/cuda/sparse_mla_bwd) through
# its standalone selftest (ffi/cuda/selftest/sparse_mla_bwd_selftest.cu): no XLA, no Python.
#
#   benchmarks/tools/bwd_selftest_variants.sh build NAME [NVCC_FLAG ...]   (here; no GPU needed)
#   benchmarks/tools/bwd_selftest_variants.sh run [--steps LIST] NAME ...  (on the SM90 machine)
#
# build: compiles the selftest with the checkout's kernels and the given flags (e.g.
#   -DJAX_DSA_BWD_ASPLIT=2) into build/bwd_selftest/NAME/sparse_mla_bwd_selftest (20-70 s on two
#   cores); prints ptxas' spill warnings. Carry build/bwd_selftest to the GPU machine.
# run: for each NAME in turn, the steps of LIST (default oracle,16k,128k):
#   oracle  the float64-oracle cases, both modes, and the determinism check
#   16k     --bench-only: S 16384, all K 2048 slots valid, uniform
#   128k    --bench-s 131072 --causal --sorted
#   ncu16k  Nsight Compute on one atomic MainKernelWs launch of the 16K bench (the 4th): speed of
#           light, warp states (stall reasons), memory tables and L2 reduction sectors
#   then the first NAME's first bench step again (drift over the call). Each step runs under
#   `timeout` (STEP_TIMEOUT seconds, default 240). The whole log goes to $OUT/bwd_selftest.log
#   (or ./bwd_selftest.log); the summary (medians, fingerprints, verdicts) to stdout. Equal
#   deterministic fingerprints across builds mean bitwise-equal dq and dkv. Exit status: 1 when
#   any step failed or timed out.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1; shift
case $cmd in
  build)
    name=$1; shift
    case $name in "" | .* | */*) echo "bwd_selftest_variants: NAME '$name' must be a plain file name" >&2; exit 2 ;; esac
    out=$root/build/bwd_selftest/$name
    mkdir -p "$out"
    cd "$root" || exit 1
    # sm_90a only: plain -arch=sm_90a also embeds compute_90 PTX, which cannot hold wgmma.
    nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -I ffi -lineinfo -Xptxas=-warn-spills "$@" \
      -o "$out/sparse_mla_bwd_selftest" ffi/cuda/selftest/sparse_mla_bwd_selftest.cu \
      ffi/cuda/sparse_mla_bwd/kernels.cu ffi/cuda/slot_compact/kernels.cu || exit 1
    { echo "flags: $*"; echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- ffi || echo '+dirty')"; } \
      > "$out/build.txt"
    echo "built $out/sparse_mla_bwd_selftest ($*)"
    ;;
  run)
    steps=oracle,16k,128k
    if [ "$1" = --steps ]; then steps=$2; shift 2; fi
    [ $# -ge 1 ] || usage
    log=${OUT:-.}/bwd_selftest.log
    mkdir -p "$(dirname "$log")" && : > "$log" || exit 1
    rc=0
    step() {  # NAME STEP: one step of one build, its summary lines to stdout
      local bin=$root/build/bwd_selftest/$1/sparse_mla_bwd_selftest args
      case $2 in
        oracle) args=() ;;
        16k) args=(--bench-only) ;;
        128k) args=(--bench-s 131072 --causal --sorted) ;;
        ncu16k) args=(--bench-only) ;;
        *) echo "bwd_selftest_variants: unknown step '$2'" >&2; return 2 ;;
      esac
      [ -x "$bin" ] || { echo "$1 $2: no build (run the build command first)"; return 1; }
      echo "== $1 $2 ($(cat "$root/build/bwd_selftest/$1/build.txt" | tr '\n' ' '))" >> "$log"
      local t0=$SECONDS s
      local pre=()
      [ "$2" = ncu16k ] && pre=(ncu --clock-control none --kernel-name regex:MainKernelWs --launch-skip 3
        --launch-count 1 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis
        --section MemoryWorkloadAnalysis_Tables --print-details all --metrics lts__t_sectors_op_red.sum,lts__t_requests_op_red.sum)
      timeout "${STEP_TIMEOUT:-240}" "${pre[@]}" "$bin" "${args[@]}" >> "$log" 2>&1
      s=$?
      echo "-- exit $s after $((SECONDS - t0)) s" >> "$log"
      # the last section of the log is this step's
      awk '/^== /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$log" |
        grep -E '^== |median|fingerprint|=> |FAIL|refused|failed|\.cu:[0-9]+ |^-- exit|Stall|Duration|Throughput|op_red|Hit Rate' |
        sed "s/^/[$1 $2] /"
      [ $s -eq 0 ]
    }
    IFS=, read -r -a list <<< "$steps"
    for name in "$@"; do
      for s in "${list[@]}"; do step "$name" "$s" || rc=1; done
    done
    for s in "${list[@]}"; do  # drift: the first build's first bench step again
      if [ "$s" != oracle ] && [ "$s" != ncu16k ] && [ $# -gt 1 ]; then step "$1" "$s" || rc=1; break; fi
    done
    exit $rc
    ;;
  *) usage ;;
esac
