#!/usr/bin/env bash
# The GPU suite and the seed examples, in one command.
#
# Question:
#   Every GPU result of docs/benchmarks.md sections 1-6 at once: what watch()
#   costs, logging with MetricBuffer, memory sampling, watch() against the
#   alternatives, detection quality, and the seed examples. (The one-off
#   studies of the pageable-copy threshold and the Lightning callback per step
#   shape were run by scripts removed after 47ff063; their results stay.)
#
# Design:
#   Runs, one after the other, bench_core.py, bench_metrics.py,
#   bench_memory.py, bench_alternatives.py, bench_detection.py (each script's docstring says its question and design)
#   and the four seed examples (examples/async_vs_sync.py,
#   logging_item_vs_buffer.py, pageable_vs_pinned.py, memory_pileup.py). Writes
#   NAME.json (the numbers) and NAME.txt (the printed tables) per benchmark
#   under RESULTS_DIR, and examples/NAME.json, examples/NAME.txt and each
#   variant's barrierguard report under RESULTS_DIR/examples/. Stops at the
#   first failure; refuses a machine without CUDA. RESULTS_DIR (the first
#   argument) defaults to benchmarks/results. The Lightning fits of
#   section 7 (bench_lightning.py) run apart: its docstring gives its commands.
#
# Reproduce:
#   bash benchmarks/run_all.sh benchmarks/results/h200     # about 485 s on the H200
#
#   The committed results are its steps run one by one at 2c45661, each with
#   the arguments this script gives it (core 45 s, pageable 5, metrics 175,
#   memory 52, alternatives 139, lightning_shapes 26, detection 8, examples 65).
#
#   One-off studies whose scripts were removed after 47ff063; their committed
#   results stay, and are reproduced from that commit (git checkout 47ff063):
#     PYTHONPATH=src python benchmarks/bench_pageable.py --out benchmarks/results/h200/pageable.json
#     PYTHONPATH=src python benchmarks/bench_lightning_shapes.py \
#         --out benchmarks/results/h200/lightning_shapes.json
#     PYTHONPATH=src python benchmarks/bench_lightning_costs.py \
#         --out benchmarks/results/h200/lightning_costs.json
#   and one whose script was removed after ae4bc18 (git checkout ae4bc18; the
#   example's files from pytorch/examples word_language_model in a folder WLM):
#     PYTHONPATH=src python benchmarks/public_script.py --example WLM --engine cuda \
#         --out benchmarks/results/h200/public_script_cuda.json
#     PYTHONPATH=src python benchmarks/public_script.py --example WLM --engine audit \
#         --out benchmarks/results/public_script_audit_cpu.json
#   and two whose scripts were removed after 79963a1 (git checkout 79963a1):
#     PYTHONPATH=src python benchmarks/bench_optimizer.py --pin 2 \
#         --out benchmarks/results/h200/optimizer_ab/optimizer_hostreads_1.json
#     (benchmarks/results/h200/optimizer_ab/ holds four such runs, two with src/
#     at ee84b70; its README.txt gives the table)
#     PYTHONPATH=src python benchmarks/bench_merge.py --out benchmarks/results/merge_cpu.json
#   and the twin fits of bench_lightning.py, removed after 40de130 (git checkout
#   40de130; two H200s of one host):
#     PYTHONPATH=src python benchmarks/bench_lightning.py --twin 6000 --fits 2 \
#         --out benchmarks/results/h200/lightning_twin_mlp_callback.json
#     PYTHONPATH=src python benchmarks/bench_lightning.py --twin 6000 --fits 2 \
#         --switch memory-off --out benchmarks/results/h200/lightning_twin_mlp_memory-off.json
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
