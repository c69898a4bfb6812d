#!/usr/bin/env bash
# Every GPU benchmark and the seed examples, in one command (meant to take < 10 min on an H200).
#
#   bash benchmarks/run_all.sh [RESULTS_DIR]      # default: benchmarks/results
#
# Writes NAME.json (the numbers) and NAME.txt (the printed tables) per benchmark
# under RESULTS_DIR, and examples/NAME.json plus each variant's barrierguard
# report under RESULTS_DIR/examples/. Stops at the first failure.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/results}"
mkdir -p "$OUT/examples"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "run_all.sh: no CUDA device here; these are the GPU benchmarks" >&2
    exit 2
fi

step() {
    local name="$1"
    shift
    local t0=$SECONDS
    echo "== $name: $*"
    "$PY" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "== $name: $((SECONDS - t0)) s"
}

step core benchmarks/bench_core.py --out "$OUT/core.json"
step metrics benchmarks/bench_metrics.py --out "$OUT/metrics.json"
step memory benchmarks/bench_memory.py --out "$OUT/memory.json"
step alternatives benchmarks/bench_alternatives.py --out "$OUT/alternatives.json"
step detection benchmarks/bench_detection.py --out "$OUT/detection.json"
for ex in async_vs_sync logging_item_vs_buffer pageable_vs_pinned memory_pileup; do
    step "examples/$ex" "examples/$ex.py" --json "$OUT/examples/$ex.json" \
        --report-dir "$OUT/examples/$ex"
done
echo "all results under $OUT (total $SECONDS s)"
