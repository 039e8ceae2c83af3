#!/usr/bin/env bash
# Every GPU check in one call, for a CUDA machine that is lent for a few minutes:
#   the GPU tests (Triton kernels, CUDA graphs against eager), scripts/bench_attention.py,
#   bench.py --preset gpu --compare hf, then the prefix and chunked presets; a short table at the end.
# Installs nothing when torch, triton and transformers are importable. Logs and JSON go to $OUT
# (or /tmp/gpu_check). Each part has its own time limit, so the whole stays under 10 minutes (one device call).
#   usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"

if ! $PY -c "import torch, triton, transformers, xxhash, safetensors, tqdm" 2>/dev/null; then
    echo "installing the missing dependencies from PyPI"
    $PY -m pip install --quiet --timeout 20 torch triton transformers xxhash safetensors tqdm pytest
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__,
'| transformers', transformers.__version__)"

# run NAME SECONDS COMMAND...: the command's output goes to $LOGS/NAME.log (and the screen).
run() {
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%-16s exit %-3s %4ss\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$SUMMARY"
}

# The tests that need no default model (it is not on a bare GPU machine): kernels and graphs on CUDA.
run tests 120 $PY -m pytest -q tests/test_triton_attention.py tests/test_cuda_graphs.py
run tests_cuda_k 45 $PY -m pytest -q tests -k "cuda or gpu" \
    --ignore=tests/test_triton_attention.py --ignore=tests/test_cuda_graphs.py
run bench_attn 60 $PY scripts/bench_attention.py
run bench_gpu 220 $PY bench.py --preset gpu --compare hf --json
run bench_prefix 50 $PY bench.py --preset prefix --enforce-eager --json
run bench_chunked 75 $PY bench.py --preset chunked --json

echo
echo "=== summary ($(date -u +%FT%TZ))"
cat "$SUMMARY"
$PY - "$LOGS" <<'EOF'
import json, sys
from pathlib import Path

def last_json(name):
    path = Path(sys.argv[1]) / f"{name}.log"
    lines = [l for l in path.read_text().splitlines() if l.startswith("{")] if path.exists() else []
    return json.loads(lines[-1]) if lines else None

gpu = last_json("bench_gpu")
if gpu:
    print(f"\ngpu preset on {gpu['device']}, {gpu['dtype']}")
    for run in gpu["runs"]:
        print(f"  {run['name']:<30} {run['output_tokens']:>8} tok {run['seconds']:>8.2f} s "
              f"{run['tokens_per_s']:>10,.0f} tok/s   ours/it {run['ours_over_this']:.2f}x")
    print(f"  roofline: floor {gpu['roofline_floor_s']:.2f} s ({gpu['roofline_bound']}-bound; compute "
          f"{gpu['roofline_compute_s']:.2f} s at {gpu['matmul_tflops']:.0f} TFLOP/s, memory "
          f"{gpu['roofline_memory_s']:.2f} s at {gpu['copy_gb_per_s']:.0f} GB/s); "
          f"ours = {gpu['ours_percent_of_roofline']:.0f}% of it")
for name in ("bench_prefix", "bench_chunked"):
    report = last_json(name)
    if report:
        print(f"\n{report['preset']} preset: " + ", ".join(
            f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}"
            for k, v in report.items() if k not in ("preset", "model", "device")))
EOF
