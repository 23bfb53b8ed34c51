#!/usr/bin/env bash
# One prepared GPU check, about 10 minutes: the CUDA kernel tests, the quick kernel benchmark, the
# step-time benchmark, the true memory peaks and a short training run, all logged to
# bench/gpu_check.log. Installs nothing. Run from anywhere:
#
#     bash bench/gpu_check.sh            # writes bench/gpu_check.log and bench/kernels_gpu.md
#
# With the device tool: run it with carry=["data/shakespeare"] (prepared here with
# `python data/prepare.py`), since the GPU machine cannot download the text.
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
step "bench --quick" 100 python bench/kernels.py --quick --out bench/kernels_gpu.md
# STEP's last stage against vanilla at 350M width (8 of its 24 layers), compiled, bf16 autocast
step "bench/train.py 350M width" 90 python bench/train.py config/step_350m.py --layers 8 --batch 8 --block 1024 --vocab 32000 --compile
# the true step peak (torch.cuda.max_memory_allocated per step and stage change) beside the plan:
# step_small, then 350M and 1B at micro-batch 1 on random tokens of their 32k vocabulary
step "memory step_small" 60 python bench/memory.py --device cuda --set batch_size=4 --modes plain,ckpt+chunk
python -c "import sys; sys.path.insert(0, '.'); from tests.helpers import write_dataset; write_dataset('/tmp/synth32k', vocab=32000)"
step "memory 350M" 90 python bench/memory.py --device cuda --config config/step_350m.py --only vanilla,step2 --modes plain,ckpt+chunk --set batch_size=1 --set data_dir=/tmp/synth32k
step "memory 1B" 150 python bench/memory.py --device cuda --config config/step_1b.py --only vanilla,step3 --modes plain --set batch_size=1 --set data_dir=/tmp/synth32k
# STEP vs vanilla at the small scale, with torch.compile as users run it (bf16 autocast, Triton
# kernels in the frozen layers). The device has no internet: carry data/shakespeare with the tree.
if [ -f data/shakespeare/train.bin ]; then
    step "train step_small" 100 python train.py config/step_small.py --out_dir=out-gpucheck-step
    step "train vanilla_small" 100 python train.py config/vanilla_small.py --out_dir=out-gpucheck-vanilla
else
    echo "=== train: skipped, data/shakespeare/train.bin is missing (prepare it here, then carry it)"
fi

echo
echo "gpu_check done in ${SECONDS}s, $([ $failed -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
echo "log: $(pwd)/$LOG"
exit $failed
