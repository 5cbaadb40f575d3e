#!/usr/bin/env bash
# Turn a short GPU lease into figures: about 11 minutes on one H100 or H200, in two calls
# of a 15-minute lease (a call may run 10 minutes; see --only below).
#
#   scripts/gpu_check.sh OUTDIR [--device cpu] [--only PART,PART...]
#
# In priority order, each part under its own time limit so that a slow one cannot eat the next
# (the limits are what an H200 with torch 2.11 took, 2026-11-27, with some room):
#   machine    the GPU, driver, torch build, CUDA, cuDNN             -> OUTDIR/machine.txt
#   tests      the CUDA tests that run eagerly, 8 at once on the one GPU, each named as it
#              ends: two stores eager and with dropout, verify with a resume, FSDP2 at world
#              size 1 against unsharded training, the fused AdamW, the fingerprints on the
#              device                                                 -> OUTDIR/tests.log
#   parts      benchmarks/gpu.py --parts: bt's update part by part    -> OUTDIR/parts.log
#   architecture  benchmarks/gpu.py --architecture: forward+backward of the reference GPT and
#              of buildtrain's model with its norm, MLP or RoPE swapped for the reference's, and
#              the kernels that differ: where the plain loop's distance to the reference is
#                                                                     -> OUTDIR/architecture.log
#   eager      bt run and the eager loops, rounds fitted to a budget   -> OUTDIR/eager.log
#   compiled   `bt run` compiled and the eager reference GPT first (the goal's ratio), then the
#              compiled loops; one compiled bt run took over 80 s      -> OUTDIR/compiled.log
#   compiled-tests  two stores compiled, compiled through a kill and resume: each compiles
#              GPT-2-sized graphs in fresh processes (146 s alone in 2026-11; with the eager
#              tests beside them, 180 s ran out before they ended)   -> OUTDIR/compiled-tests.log
# The parts take about 11 minutes together, more than one 10-minute call: `--only` runs the
# named ones (`--only tests,parts,architecture,eager`, 5 minutes, then `--only
# compiled,compiled-tests`, 6.5 minutes, in a second call of the lease).
# `gpu.py --profile` (bt's kernels against the plain loop's) and `gpu.py --workspace` (the pinned
# cuBLAS workspace, 1.23x slower on an H200) answered their questions in 2026-11's leases and
# are no longer in the sequence; run them by hand where a new torch may change the answer.
# Every figure is printed as it comes and appended to OUTDIR/figures.jsonl, so whatever the
# lease cuts short, what was measured before is kept. `--device cpu` runs the same sequence on
# the CPU at a small shape, to check the script anywhere. The exit status is the first failing
# part's (a part that runs out of time exits 124), after every part has had its turn.
set -uo pipefail

usage="usage: scripts/gpu_check.sh OUTDIR [--device cpu] [--only PART,PART...]"
out=${1:?$usage}
shift
device=cuda
only=""
while [ $# -gt 0 ]; do
    case $1 in
        --device) device=${2:?--device needs cuda or cpu}; shift 2 ;;
        --only) only=${2:?--only needs a comma-separated list of parts}; shift 2 ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
done
parts="tests parts architecture eager compiled compiled-tests"  # in the order they run
for name in ${only//,/ }; do
    if [[ " $parts " != *" $name "* ]]; then
        echo "gpu_check.sh: --only: no part named '$name' (the parts: ${parts// /, })" >&2
        exit 2
    fi
done
cd "$(dirname "$0")/.."
mkdir -p "$out"
figures="$out/figures.jsonl"
status=0

part() {  # part NAME SECONDS COMMAND...: run it, print and keep its output, remember a failure
    local name=$1 seconds=$2
    shift 2
    if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then
        return
    fi
    echo "== $name (at most ${seconds} s): $*"
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "== $name: exit $code"
    if [ "$status" -eq 0 ] && [ "$code" -ne 0 ]; then
        status=$code
    fi
}

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    git rev-parse --short=12 HEAD 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
} 2>&1 | tee "$out/machine.txt"

cuda_tests=(tests/test_cuda.py tests/test_optimizer.py tests/test_arriving.py tests/test_fingerprint.py::test_a_gpu_computes_the_sums_of_the_host)
part tests 120 python -m pytest -v -n 8 --dist load -p no:cacheprovider --durations=8 -k "not compiled" "${cuda_tests[@]}"
part parts 55 python benchmarks/gpu.py --parts --device "$device" --jsonl "$figures"
part architecture 45 python benchmarks/gpu.py --architecture --device "$device" --jsonl "$figures"
part eager 90 python benchmarks/gpu.py --device "$device" --budget 75 --jsonl "$figures"
part compiled 180 python benchmarks/gpu.py --device "$device" --only-compiled --budget 150 --jsonl "$figures"
part compiled-tests 200 python -m pytest -v -n 2 --dist load -p no:cacheprovider --durations=8 -k compiled "${cuda_tests[@]}"
echo "figures: $figures ($(wc -l < "$figures" 2>/dev/null || echo 0) lines)"
exit "$status"
