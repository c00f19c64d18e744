#!/usr/bin/env bash
# The first check on a machine with a GPU, in under 10 minutes; every result lands in one folder.
#
# Feeds docs/compile.md ("On a GPU"), docs/parallelize.md (the communication share) and docs/hf-models.md
# (compiled EP on a GPU) once run on a GPU; until then the pages give CPU figures only.
#
#   benchmarks/device_check.sh [OUT_DIR]          # default OUT_DIR: device-check-out
#   benchmarks/device_check.sh --dry-run [OUT_DIR] # print each step's command, run nothing (no GPU needed;
#                                                  # DEVICE_CHECK_GPUS=N: plan for N GPUs, default 1)
#
# Steps (each under its own time limit, all within DEVICE_CHECK_BUDGET seconds, default 560):
#   env          nvidia-smi, torch and the GPUs torch sees                      -> env.log
#   conformance  tplower vs DTensor on CUDA tensors over NCCL, forward and backward
#                (benchmarks/nccl_conformance.py under torchrun)                 -> conformance.json, conformance.log
#   run          tplower run --backend nccl: llama-tiny parallelized on NCCL ranks,
#                checked against one process                                      -> run.json, run.log
#   bench_micro  tplower bench micro and memory phases on CUDA (NCCL), quick      -> bench_micro/, bench_micro.log
#   bench_share  the model phase on CUDA ranks, each parallel copy beside its communication floor (the same
#                copy on a fake group): (step - floor) / floor for tplower (overlap on and off),
#                parallelize_module and the hand-written Megatron copy (benchmarks/comm_share.py; NCCL with
#                a GPU per rank, gloo through the host when 2 ranks share one GPU) -> bench_share/, bench_share.log
#   bench_moe    tplower bench moe phase: one Qwen3-MoE layer's train step, tplower and transformers, TP and EP,
#                eager and compiled EP (inductor; spawned gloo ranks on the host CPUs) -> bench_moe/, bench_moe.log
#   bench_model  tplower bench model phase with compiled (inductor) and eager rows -> bench_model/, bench_model.log
#                (MiniLM on spawned gloo ranks: the host CPUs, whatever the GPU count)
#   summary.txt  one line per step: its exit status and seconds; then the communication share lines and the
#                MoE step lines (compiled EP against transformers' and against eager)
#
# Ranks: one per GPU (up to 8; tplower run up to 4, a count that divides llama-tiny's heads, and 1 on one GPU,
# where NCCL cannot put two ranks of the run on one device). With one GPU the other
# NCCL steps start 2 ranks on it; NCCL may refuse two ranks on one device ("Duplicate GPU detected"): the step's
# log says so and the script goes on.
#
# Without a CUDA GPU it refuses at once: one line on stderr, exit status 2, nothing written.
set -u

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-device-check-out}
PY=${PYTHON:-python}
BUDGET=${DEVICE_CHECK_BUDGET:-560}
HERE=$(cd "$(dirname "$0")" && pwd)

if [ "$DRY" = 1 ]; then
    ngpu=${DEVICE_CHECK_GPUS:-1}
else
    ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
fi
if [ -z "$ngpu" ] || [ "$ngpu" = 0 ]; then
    echo "device_check: refused: no CUDA GPU visible to torch (torch.cuda.is_available() is False); run it on a machine with a GPU" >&2
    exit 2
fi

if [ "$DRY" = 0 ]; then mkdir -p "$OUT" && : > "$OUT/summary.txt"; fi
start_all=$(date +%s)
failed=0

if [ "$ngpu" -ge 2 ]; then np=$(( ngpu < 8 ? ngpu : 8 )); else np=2; fi
if [ "$ngpu" -ge 4 ]; then np_run=4; elif [ "$ngpu" -ge 2 ]; then np_run=2; else np_run=1; fi

# step NAME LIMIT_S COMMAND...: run COMMAND with its output in NAME.log, under LIMIT_S and the budget left.
step() {
    local name=$1 limit=$2
    shift 2
    if [ "$DRY" = 1 ]; then
        echo "$name (${limit}s): $*"
        return
    fi
    local left=$(( BUDGET - ($(date +%s) - start_all) ))
    if [ "$left" -lt 10 ]; then
        echo "$name: skipped (budget of ${BUDGET}s spent)" | tee -a "$OUT/summary.txt"
        failed=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s)"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ "$rc" -ne 0 ] && failed=1
    local why=""
    [ "$rc" -eq 124 ] && why=" (timed out)"
    echo "$name: rc=$rc$why $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

step env 30 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); print(\"nccl\", torch.cuda.nccl.version())'; nproc"
step conformance 75 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$np" \
    "$HERE/nccl_conformance.py" --out "$OUT/conformance.json"
[ "$DRY" = 0 ] && rm -rf /tmp/torchelastic_* 2>/dev/null
step run 100 "$PY" -m tplower.cli run --model llama-tiny --backend nccl --nproc "$np_run" --steps 2 --repeat 3 \
    --json "$OUT/run.json" --no-progress
step bench_micro 100 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$np" \
    "$HERE/bench.py" --device cuda --phases micro,memory --quick --no-plots --out "$OUT/bench_micro"
[ "$DRY" = 0 ] && rm -rf /tmp/torchelastic_* 2>/dev/null
step bench_share 120 "$PY" "$HERE/comm_share.py" --device cuda --backend auto --rounds 7 --out "$OUT/bench_share"
step bench_moe 90 "$PY" -m tplower.cli bench --phases moe --compile --quick --no-plots --out "$OUT/bench_moe"
step bench_model 200 "$PY" -m tplower.cli bench --phases model --compile --quick --no-plots --out "$OUT/bench_model"

[ "$DRY" = 1 ] && exit 0
# the communication share of each library's eager step on the GPU ranks, and on the host CPUs (gloo)
for md in "$OUT/bench_share/share.md" "$OUT/bench_model/bench.md"; do
    [ -f "$md" ] && grep -h "communication share" "$md" | sed "s|^- |$(basename "$(dirname "$md")"): |" | tee -a "$OUT/summary.txt"
done
[ -f "$OUT/bench_moe/bench.md" ] && grep -h "^- MoE layer train step" "$OUT/bench_moe/bench.md" | sed "s|^- |bench_moe: |" | tee -a "$OUT/summary.txt"
echo "total: $(( $(date +%s) - start_all ))s; results in $OUT" | tee -a "$OUT/summary.txt"
exit "$failed"
