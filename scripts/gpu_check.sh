#!/usr/bin/env bash
# Turn a short GPU lease into figures: one command, about 8 minutes on one H100 or H200.
#
#   scripts/gpu_check.sh OUTDIR [--device cpu]
#
# In priority order, each part under its own time limit so that a slow one cannot eat the next:
#   machine    the GPU, driver, torch build, CUDA, cuDNN             -> OUTDIR/machine.txt
#   workspace  forward+backward with and without CUBLAS_WORKSPACE_CONFIG=:4096:8, fresh
#              processes alternated (gpu.py --workspace)            -> OUTDIR/workspace.log
#   tests      the CUDA tests: two stores, dropout, compiled, verify with a resume, the fused
#              AdamW, the fingerprints on the device                 -> OUTDIR/tests.log
#   parts      benchmarks/gpu.py --parts: bt's update part by part    -> OUTDIR/parts.log
#   profile    benchmarks/gpu.py --profile: the kernels of the plain loop's forward+backward
#              against bt's, where the time between them goes         -> OUTDIR/profile.log
#   eager      bt run and the eager loops, rounds fitted to a budget   -> OUTDIR/eager.log
#   compiled   the torch.compile contenders and the eager reference    -> OUTDIR/compiled.log
#   more-tests the longer CUDA tests: compiled through a kill and resume, FSDP2 at world size 1
#              against unsharded training                            -> OUTDIR/more-tests.log
# Every figure is printed as it comes and appended to OUTDIR/figures.jsonl, so whatever the
# lease cuts short, what was measured before is kept. `--device cpu` runs the same sequence on
# the CPU at a small shape, to check the script anywhere. The exit status is the first failing
# part's (a part that runs out of time exits 124), after every part has had its turn.
set -uo pipefail

out=${1:?usage: scripts/gpu_check.sh OUTDIR [--device cpu]}
device=cuda
if [ "${2:-}" = "--device" ]; then
    device=${3:?--device needs cuda or cpu}
fi
cd "$(dirname "$0")/.."
mkdir -p "$out"
figures="$out/figures.jsonl"
status=0

part() {  # part NAME SECONDS COMMAND...: run it, print and keep its output, remember a failure
    local name=$1 seconds=$2
    shift 2
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

part workspace 50 python benchmarks/gpu.py --workspace --device "$device" --budget 40 --jsonl "$figures"
part tests 90 python -m pytest -q -n 0 -p no:cacheprovider -m "not long_cuda" \
    tests/test_cuda.py tests/test_optimizer.py tests/test_fingerprint.py::test_a_gpu_computes_the_sums_of_the_host
part parts 55 python benchmarks/gpu.py --parts --device "$device" --jsonl "$figures"
part profile 45 python benchmarks/gpu.py --profile --device "$device" --jsonl "$figures"
part eager 100 python benchmarks/gpu.py --device "$device" --budget 85 --jsonl "$figures"
part compiled 110 python benchmarks/gpu.py --device "$device" --only-compiled --budget 95 --jsonl "$figures"
part more-tests 60 python -m pytest -q -n 0 -p no:cacheprovider -m long_cuda tests/test_cuda.py
echo "figures: $figures ($(wc -l < "$figures" 2>/dev/null || echo 0) lines)"
exit "$status"
