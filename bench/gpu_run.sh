#!/usr/bin/env bash
# Issue 31 on a GPU machine in one command, at most about 8 minutes:
#     bash bench/gpu_run.sh OUT_DIR
# from anywhere inside the checkout. Writes at most 7 flat files into OUT_DIR: env.txt (GPU, driver,
# versions), test_gpu.log and junit.xml (`make test-gpu`: the tests marked cuda), bench_gpu.log,
# gpu.json and gpu.md (bench/bench_gpu.py), status.txt (exit codes). GPU_PY picks the Python
# (default python3). Each stage has its own `timeout`; a stage that fails does not stop the next.
set -u
OUT=${1:?usage: bash bench/gpu_run.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.." || exit 2
PY=${GPU_PY:-python3}
TEST_S=${GPU_TEST_TIMEOUT:-210}    # the tests marked cuda: a budget of about 3 minutes
BENCH_S=${GPU_BENCH_TIMEOUT:-240}  # the bench stops starting new cases after BENCH_BUDGET seconds
BENCH_BUDGET=${GPU_BENCH_BUDGET:-170}
start=$(date +%s)

{
  echo "date: $(date -u)"
  echo "checkout: $(pwd) $(git log -1 --format='%h %s' 2>/dev/null || echo '(no git)')"
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
  echo "cpus: $(nproc)"
  timeout 60 "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
if torch.cuda.is_available():
    print("capability", torch.cuda.get_device_capability(0))
for name in ("transformers", "accelerate", "peft", "safetensors", "hypothesis", "pytest", "numpy",
             "gguf", "hqq", "torchao", "compressed_tensors", "quark", "onnx", "triton"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:
        print(name, "-", type(e).__name__)
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== make test-gpu (timeout ${TEST_S}s)"
if command -v make > /dev/null; then
  timeout -k 10 "$TEST_S" make --no-print-directory test-gpu GPU_PY="$PY" \
    GPU_PYTEST_ARGS="--junitxml=$OUT/junit.xml" > "$OUT/test_gpu.log" 2>&1
else  # no make on the machine: the same command as the Makefile's test-gpu
  PYTHONPATH=. HYPOTHESIS_PROFILE=ci QTRANSFORM_NO_NATIVE_KERNELS=1 HF_HUB_OFFLINE=1 timeout -k 10 "$TEST_S" \
    "$PY" -m pytest -q -p no:xdist -m cuda --continue-on-collection-errors -rfEs --durations=15 \
    --junitxml="$OUT/junit.xml" tests property_tests > "$OUT/test_gpu.log" 2>&1
fi
test_rc=$?
tail -n 60 "$OUT/test_gpu.log"

echo "== bench/bench_gpu.py (timeout ${BENCH_S}s, budget ${BENCH_BUDGET}s)"
PYTHONPATH=. QTRANSFORM_NO_NATIVE_KERNELS=1 HF_HUB_OFFLINE=1 timeout -k 10 "$BENCH_S" \
  "$PY" bench/bench_gpu.py --out "$OUT/gpu.json" --budget "$BENCH_BUDGET" > "$OUT/bench_gpu.log" 2>&1
bench_rc=$?
grep -v '^\[' "$OUT/bench_gpu.log" | tail -n 60
if [ ! -f "$OUT/gpu.md" ] && [ -f "$OUT/gpu.json" ]; then  # cut by the timeout: the table from what was measured
  PYTHONPATH=. "$PY" -c "import json,sys; sys.path.insert(0,'bench'); import bench_gpu as b; \
d=json.load(open('$OUT/gpu.json')); open('$OUT/gpu.md','w').write(b.table(d)+'\n'); print(b.table(d))" \
    >> "$OUT/bench_gpu.log" 2>&1 && cat "$OUT/gpu.md"
fi

echo "make test-gpu rc=$test_rc (124: timed out); bench_gpu.py rc=$bench_rc; total $(( $(date +%s) - start ))s" \
  | tee "$OUT/status.txt"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
