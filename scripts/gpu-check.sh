#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU (driver + CUDA 12.x libraries: libcuda, libnvrtc,
# libcublas on the loader path). Builds with the CUDA backend, runs the GPU tests (every op
# against the CPU backend, GCN on Cora against the CPU trainer) and the benchmark (SpMM
# bandwidth vs the card's, GEMM TFLOP/s, GCN epoch time on Cora and on the 1M-node synthetic
# graph, 1 vs 4 streams). Each step has a timeout; they add up to 465 s, under 8 minutes.
# A test that reports "SKIPPED cuda" fails the check: on a GPU machine nothing may be skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
CORA=${CORA:-../shared/datasets/cora}
LOG=$(mktemp -d)/gpu-check
mkdir -p "$LOG"
start=$SECONDS
step() { echo "== $1 ($((SECONDS - start)) s)"; }

step "GPU"
timeout 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

step "build (release, --features cuda)"
timeout 210 cargo build --release --features cuda --tests --examples

step "op tests: every kernel against the CPU backend"
timeout 45 cargo test --release -p trellis-gpu --features cuda --test backends --test cuda_source \
    2>&1 | tee "$LOG/ops.txt"
step "GCN on Cora: GPU vs CPU trainer"
timeout 60 cargo test --release --features cuda --test gpu_gcn -- --nocapture \
    2>&1 | tee "$LOG/gcn.txt"
if grep -h "SKIPPED cuda" "$LOG/ops.txt" "$LOG/gcn.txt"; then
    echo "FAILED: CUDA tests were skipped on a GPU machine" >&2
    exit 1
fi

step "trellis train --device cuda (Cora, paper settings)"
timeout 30 cargo run --release --features cuda -- train --data "$CORA" --model gcn --device cuda

step "benchmark"
timeout 110 cargo run --release --features cuda --example gpu_bench -- --cora "$CORA"

step "done in $((SECONDS - start)) s"
