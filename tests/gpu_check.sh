#!/usr/bin/env bash
# The GPU checks in one short run on a lent GPU node (one H100 or H200, 16 cores, offline): at most 10 minutes
# however it goes, and every failure explained.
#
#   tests/gpu_check.sh --plan [STEP...]   the steps, each with its limit, and the worst case; runs nothing
#   tests/gpu_check.sh [STEP...]          the preflight, then the steps named (all of them by default)
#
# Each step runs in a session of its own (setsid) under timeout: SIGINT at its limit less GRACE seconds
# (pytest then still writes its junit file; faulthandler dumps the stacks of a test still running 10 s
# before that), KILL at its limit. After each step, whatever it left running (a Jupyter kernel, a rank: its
# session, or anything carrying its GPU_CHECK_STEP marker) is ended and named, nvidia-smi shows each GPU's
# memory and processes, and its rows are printed (tests/gpu_rows.py step-rows: each test's or row's result
# with the first line of its reason, a failure's last lines, and the log's tail when the step failed or ran
# out of time). At the end one Markdown table of every row, to paste into a note (also in
# $GPU_CHECK_LOGS/summary.md).
#
# Logs, junit files and out-of-memory snapshots stay in GPU_CHECK_LOGS (a new temporary folder by default; on
# a lent node, name one under the folder that comes back). Uses the torch already installed (a machine may
# be offline) and says what is missing instead of installing it. Exit status: 0 when every row passed or was
# skipped, 1 when one failed or ran out of time, 2 when the checks cannot run here (no GPU torch can use, a
# missing package).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
GRACE=15     # SIGINT this many seconds before a step's limit, KILL at the limit
AFTER=5      # after each step: end its leftovers (about 1 s) and nvidia-smi (at most 4 s)
SUMMARY=5    # the last table
BUDGET=600   # a lent node's 10 minutes: the worst case must fit

# name|limit (s)|what it runs: for a pytest step, the test modules whose tests marked gpu it runs. The limits
# come from the first run on one H200 (2026-12-04): doctor and the one-rank rows 45 s together; the tests of
# labs 00-05 about 6 minutes in one pytest (each lab's notebook, on the emulated cluster where the lab needs
# more ranks than the node has GPUs, and its script under torchrun on the GPU where it runs on one rank); lab
# 06's notebook not done in 75 s. The four small modules share one step: each starts one or two GPU ranks.
STEPS=(
  "preflight|45|versions (torch, CUDA, NCCL), nvidia-smi, labkit.machine._torch_compat.problems(), labkit doctor"
  "rows|60|tests/gpu_rows.py: the one-rank rows at the labs' GPU sizes"
  "core|60|tests/machine/test_launcher.py tests/test_bandwidth.py tests/trace/test_capture.py tests/test_memory.py"
  "lab00|45|tests/labs/test_00_cluster_tour.py"
  "lab01|55|tests/labs/test_01_parallelism_choice.py"
  "lab02|65|tests/labs/test_02_oom_batch.py"
  "lab03|50|tests/labs/test_03_unoverlapped_comms.py"
  "lab04|50|tests/labs/test_04_imbalanced_pipeline.py"
  "lab05|45|tests/labs/test_05_unprofiled_run.py"
  "lab06|70|tests/labs/test_06_capstone.py"
)
# lab 05's notebook profiles its job under Nsight Systems where nsys is installed and the lab runs on GPUs:
# bounded well inside the step's limit
export LABKIT_NSYS_TIMEOUT_S=${LABKIT_NSYS_TIMEOUT_S:-20}

# ---------------------------------------------------------------- which steps, and the plan

plan_only=0
asked=()
for arg in "$@"; do
  case $arg in
    --plan) plan_only=1 ;;
    -h | --help) sed -n '2,6p' "$0"; exit 0 ;;
    *) asked+=("$arg") ;;
  esac
done
selected=()  # the preflight always, then the steps asked for, in the table's order
for line in "${STEPS[@]}"; do
  name=${line%%|*}
  if [ "$name" = preflight ] || [ ${#asked[@]} -eq 0 ] || [[ " ${asked[*]} " == *" $name "* ]]; then
    selected+=("$line")
  fi
done
for name in "${asked[@]}"; do
  if [[ " ${STEPS[*]%%|*} " != *" $name "* ]]; then
    echo "gpu_check.sh: no step $name; the steps: ${STEPS[*]%%|*}" >&2
    exit 2
  fi
done

worst=$SUMMARY
for line in "${selected[@]}"; do
  IFS='|' read -r name limit what <<<"$line"
  worst=$((worst + limit + AFTER))
done
print_plan() {
  printf '%-11s %6s  %s\n' step limit "what it runs"
  for line in "${selected[@]}"; do
    IFS='|' read -r name limit what <<<"$line"
    printf '%-11s %4d s  %s\n' "$name" "$limit" "$what"
  done
  printf '%-11s %4d s  %s\n' "after each" "$((${#selected[@]} * AFTER))" \
    "${#selected[@]} x $AFTER s: end what the step left running, nvidia-smi"
  printf '%-11s %4d s  %s\n' summary "$SUMMARY" "one Markdown table of every row"
  printf 'worst case %4d s (a step gets SIGINT %d s before its limit, KILL at it; the budget: %d s)\n' \
    "$worst" "$GRACE" "$BUDGET"
}
if [ "$plan_only" -eq 1 ]; then
  print_plan
  exit 0
fi
if [ "$worst" -gt "$BUDGET" ]; then
  print_plan
  echo "gpu_check.sh: the worst case, $worst s, is over the budget of $BUDGET s: lower a step's limit" >&2
  exit 2
fi

# ---------------------------------------------------------------- running a step

logs=${GPU_CHECK_LOGS:-$(mktemp -d -t labkit-gpu-check-XXXX)}
mkdir -p "$logs" && logs=$(cd "$logs" && pwd)
# an earlier run's rows, reports and stop note (its logs are overwritten step by step)
rm -f "$logs"/summary.jsonl "$logs"/summary.md "$logs"/*.rows.jsonl "$logs"/*.xml "$logs"/stop
current=""

gpu_state() {  # each GPU's memory and the processes on it, where nvidia-smi is
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  echo "-- nvidia-smi after $1: index, memory used, total, utilisation; then pid, process, memory (if any)"
  timeout -k 1 3 sh -c '
    nvidia-smi --query-gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader' 2>&1 | sed 's/^/   /'
}

end_step() {  # end what step $1 left running: its session, and whatever carries its marker
  local sid
  sid=$(cat "$logs/$1.sid" 2>/dev/null || echo 0)
  "$PY" tests/gpu_rows.py end-leftovers "${sid:-0}" "$1.$$"
}

run_step() {  # name limit command...: run it, end what it left, print its rows; kept for the summary
  local name=$1 limit=$2 start=$SECONDS code left
  shift 2
  current=$name
  echo
  echo "== $name (limit $limit s) at $(date +%T)"
  rm -f "$logs/$name.sid"
  # setsid: a session of its own, whose id the inner shell writes down before it becomes timeout, so that
  # what the step leaves can be found and ended; timeout signals the step's whole process group.
  GPU_CHECK_STEP="$name.$$" setsid -w bash -c 'echo $$ >"$0"; exec "$@"' "$logs/$name.sid" \
    timeout -s INT -k "$GRACE" "$((limit - GRACE))" "$@" >"$logs/$name.log" 2>&1 </dev/null
  code=$?
  left=$(end_step "$name")
  # the preflight's whole log (the versions, nvidia-smi, doctor) first; the other steps' rows and failures
  "$PY" tests/gpu_rows.py step-rows "$logs" "$name" "$code" "$((SECONDS - start))" "$limit" \
    $([ "$name" = preflight ] && echo --show-log)
  [ -n "$left" ] && echo "$left"
  gpu_state "$name"
  current=""
}

pytest_step() {  # name limit modules...: the tests marked gpu in those modules
  local name=$1 limit=$2
  shift 2
  run_step "$name" "$limit" "$PY" tests/gpu_rows.py pytest -v -p no:cacheprovider -m gpu -o addopts="" \
    -o faulthandler_timeout=$((limit - GRACE - 10)) --tb=short -rfE --junitxml="$logs/$name.xml" "$@"
}

finish() {
  echo
  echo "== summary (worst case $worst s; $SECONDS s taken)"
  timeout -k 1 "$((SUMMARY - 1))" "$PY" tests/gpu_rows.py summary "$logs"
}

# Ctrl-C or a TERM: bash runs this once the current step has ended (at its limit at the latest), because the
# step is in a session of its own, which the terminal's SIGINT does not reach.
on_signal() {
  echo "gpu_check.sh: stopped during ${current:-no step}"
  [ -n "$current" ] && end_step "$current"
  finish
  exit 130
}
trap on_signal INT TERM

# ---------------------------------------------------------------- the run

echo "gpu_check.sh: logs in $logs"
print_plan
for line in "${selected[@]}"; do
  IFS='|' read -r name limit what <<<"$line"
  case $name in
    preflight)
      run_step preflight "$limit" bash -c '
        if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not on PATH"; fi
        "$0" tests/gpu_rows.py preflight "$1" || exit 2
        "$0" -m labkit.course.cli doctor --cluster auto' "$PY" "$logs"
      if [ -f "$logs/stop" ]; then
        finish
        echo "gpu_check.sh: the GPU checks cannot run here: $(cat "$logs/stop")"
        exit 2
      fi
      ;;
    rows) run_step rows "$limit" "$PY" tests/gpu_rows.py rows "$logs" ;;
    *) read -r -a modules <<<"$what" && pytest_step "$name" "$limit" "${modules[@]}" ;;
  esac
done
finish
