#!/usr/bin/env bash
# The GPU checks in one short run (under 8 minutes on one GPU), most telling first, so that a short lease still
# gives the most: the GPU, labkit doctor, the one-rank table (tests/gpu_rows.py: memory baseline, lab 02's
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
xml=$(mktemp --suffix=.xml)
# every test marked `gpu`, each beside the module it tests; a test module that fails to import is reported
# (the status is non-zero) without keeping the others from running
timeout 300 $PY -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --continue-on-collection-errors \
  --junitxml="$xml" tests/
status=$?
$PY - "$xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (ET.ParseError, FileNotFoundError):
    sys.exit("no test report (the run was stopped?)")
print(f"\n{'check':72} {'result':8} {'s':>6}")
for c in cases:
    outcome = "pass"
    for tag in ("failure", "error", "skipped"):
        node = c.find(tag)
        if node is not None:
            outcome = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
            reason = (node.get("message") or "").splitlines()[0][:60] if node.get("message") else ""
            break
    else:
        reason = ""
    print(f"{c.get('name')[:72]:72} {outcome:8} {float(c.get('time', 0)):6.1f}  {reason}")
PY
if [ "$rows" -ne 0 ]; then
  echo "the one-rank table above has a failed row (exit $rows)"
  exit 1
fi
exit $status
