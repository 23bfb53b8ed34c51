#!/usr/bin/env bash
# One prepared GPU check, under 8 minutes: the CUDA kernel tests, the quick kernel benchmark and a
# short training run, all logged to bench/gpu_check.log. Installs nothing. Run from anywhere:
#
#     bash bench/gpu_check.sh            # writes bench/gpu_check.log and bench/kernels_gpu.md
#
# Each step has its own time limit and a failing step does not stop the later ones; the exit
# status is non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=bench/gpu_check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, report rc and duration
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start))s$([ $rc -eq 124 ] && echo ' (timed out)')"
    [ $rc -eq 0 ] || failed=1
}

echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)"
nvidia-smi || failed=1
python -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"

# bf16 and autotuned cases, then the rest of the kernel tests compiled for real (no interpreter)
step "pytest -m gpu" 120 python -m pytest -q -m gpu tests/
step "kernel tests on CUDA" 60 env STEP_KERNELS=triton python -m pytest -q -m "not gpu" tests/test_kernels.py
step "bench --quick" 120 python bench/kernels.py --quick --out bench/kernels_gpu.md
# best effort: the data is not in git (carry data/shakespeare) and train.py evolves separately
if [ -f data/shakespeare/train.bin ]; then
    step "train step_small" 180 python train.py config/step_small.py --compile=False --out_dir=out-gpucheck
else
    echo "=== train step_small: skipped, data/shakespeare/train.bin is missing"
fi

echo
echo "gpu_check done in ${SECONDS}s, $([ $failed -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
echo "log: $(pwd)/$LOG"
exit $failed
