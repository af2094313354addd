#!/usr/bin/env bash
# The GPU checks in one run, most telling first, so that a short lease still gives the most (on one H200 with
# 16 cores, 2026-12-04: doctor and the one-rank table 45 s, then the tests of labs 00-05 about 6 minutes; lab
# 06's notebook did not end within 75 s; set GPU_CHECK_MODULE_S to fit a lease): the GPU, labkit doctor, the one-rank table (tests/gpu_rows.py: memory baseline, lab 02's
# estimate, cap and batch finder, fragmentation with each fix, precisions, lab 04's layer costs and lab 03's
# compute at their GPU sizes against the forecast), then the tests marked `gpu` (NCCL collectives, the memory
# estimate against CUDA's allocator, a CUDA trace, each solution notebook on the GPUs there are, each lab's
# script under torchrun) with their table. Uses the torch already installed (a machine may be offline); says
# what is missing instead of installing it. Exits non-zero if any row failed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA build of torch with a visible GPU here ($($PY -c 'import torch; print(torch.__version__)' 2>&1 | tail -1))."
  echo "install one that matches the driver (nvidia-smi shows its CUDA version), e.g."
  echo "  pip install torch --index-url https://download.pytorch.org/whl/cu128"
  exit 2
fi
missing=$($PY - <<'PY'
import importlib.util
need = ["cloudpickle", "numpy", "matplotlib", "papermill", "nbformat", "pytest", "ipykernel"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "missing Python packages: $missing (pip install -e '.[test]' where there is a network)"
  exit 2
fi

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
timeout 60 $PY -m labkit.cli doctor --cluster auto 2>&1 | tail -12
timeout 150 $PY tests/gpu_rows.py
rows=$?
# The tests marked `gpu`, one test module at a time, each under its own time limit (GPU_CHECK_MODULE_S, 150 s
# by default), the cheap modules first. The first run on an H200 (2026-12-04) ran them in one pytest under one
# limit: lab 06's notebook outlasted it, pytest was killed before it wrote its report, and the failures of labs
# 01, 02 and 05 came back with no reason. Now each module writes its own report and log as it ends; a module
# over its limit is a TIMEOUT row, and each failure's first lines are printed under the table. Logs stay in
# GPU_CHECK_LOGS (a new temporary folder by default), whose path is printed.
logs=${GPU_CHECK_LOGS:-$(mktemp -d -t labkit-gpu-check-XXXX)}
mkdir -p "$logs"
limit=${GPU_CHECK_MODULE_S:-150}
status=0
modules="tests/test_memory.py tests/test_bandwidth.py tests/test_launcher.py tests/trace/test_capture.py
$(ls tests/labs/test_0*.py)"
for module in $modules; do
  name=$(basename "$module" .py)
  timeout "$limit" $PY -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --tb=short -rfE \
    --junitxml="$logs/$name.xml" "$module" >"$logs/$name.log" 2>&1
  code=$?
  case $code in
    0 | 5) ;;  # 5: no test marked gpu was collected there
    124) echo "$module: TIMEOUT after $limit s (log: $logs/$name.log)"; status=1 ;;
    *) status=1 ;;
  esac
done
$PY - "$logs" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

failures = []
print(f"\n{'check':72} {'result':8} {'s':>6}")
for xml in sorted(Path(sys.argv[1]).glob("*.xml")):
    try:
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    except ET.ParseError:
        print(f"{xml.stem:72} {'NO REPORT':8}")
        continue
    for c in cases:
        outcome, reason = "pass", ""
        for tag in ("failure", "error", "skipped"):
            node = c.find(tag)
            if node is not None:
                outcome = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
                reason = (node.get("message") or "").splitlines()[0][:60] if node.get("message") else ""
                if tag != "skipped":
                    failures.append((c.get("name"), (node.text or node.get("message") or "").strip()))
                break
        name = f"{xml.stem.removeprefix('test_')}::{c.get('name')}"
        print(f"{name[:72]:72} {outcome:8} {float(c.get('time', 0)):6.1f}  {reason}")
for name, text in failures:
    lines = text.splitlines()
    print(f"\n--- {name}: the last 25 of {len(lines)} lines")
    print("\n".join(lines[-25:]))
PY
echo "logs: $logs"
if [ "$rows" -ne 0 ]; then
  echo "the one-rank table above has a failed row (exit $rows)"
  exit 1
fi
exit $status
