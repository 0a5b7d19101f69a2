#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU (driver + CUDA 12.x libraries: libcuda, libnvrtc,
# libcublas on the loader path). Builds with the CUDA backend, runs the GPU tests (every op
# through the Stream API against the CPU backend; GCN, SAGE and GAT on Cora against the CPU
# trainer; GPU determinism; 4 partition actors on GPU streams against the CPU) and the
# benchmark (SpMM bandwidth vs the card's, GEMM TFLOP/s, 1 vs 4 streams, GCN training steps on
# Cora and on the 1M-node synthetic graph with 1 stream and with 4 partition actors). Each
# step has a timeout; they add up to 475 s, under 8 minutes.
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
timeout 200 cargo build --release --features cuda --tests --examples

step "op tests: every kernel against the CPU backend"
timeout 40 cargo test --release -p trellis-gpu --features cuda --test backends --test cuda_source \
    2>&1 | tee "$LOG/ops.txt"
step "models and partition actors: GPU vs CPU"
timeout 90 cargo test --release --features cuda --test gpu_training -- --nocapture \
    2>&1 | tee "$LOG/models.txt"
if grep -h "SKIPPED cuda" "$LOG/ops.txt" "$LOG/models.txt"; then
    echo "FAILED: CUDA tests were skipped on a GPU machine" >&2
    exit 1
fi

step "trellis train --device cuda (Cora, paper settings; GAT on 4 partition actors)"
timeout 15 cargo run --release --features cuda -- train --data "$CORA" --model gcn --device cuda
timeout 20 cargo run --release --features cuda -- train --data "$CORA" --model gat --device cuda \
    --partitions 4

step "benchmark"
timeout 100 cargo run --release --features cuda --example gpu_bench -- --cora "$CORA"

step "done in $((SECONDS - start)) s"
