#!/usr/bin/env bash
# Epoch time with an OpenTelemetry collector that is down vs no export at all, interleaved
# (A, B, A, B, ...) so machine noise hits both alike. Prints each run's median step time and
# the ratios of the medians and of the minima (noise on a shared machine only adds time, so
# the minima are the better estimate there). Usage: scripts/telemetry_overhead.sh [RUNS] [DATA]
set -euo pipefail
runs=${1:-6}
data=${2:-synthetic:nodes=100000,degree=10,features=64,classes=8,seed=1}
bin=${TRELLIS:-target/release/trellis}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
step_ms() {
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['latency']['step']['p50_ms'])" "$1"
}
a=(); b=()
for i in $(seq "$runs"); do
  "$bin" train --data "$data" --partitions 2 --epochs 12 --report "$tmp/a.json" >/dev/null 2>&1
  a+=("$(step_ms "$tmp/a.json")")
  # Port 9 (discard) on loopback: nothing listens, every export fails.
  "$bin" train --data "$data" --partitions 2 --epochs 12 --report "$tmp/b.json" \
    --otlp-endpoint http://127.0.0.1:9 >/dev/null 2>&1
  b+=("$(step_ms "$tmp/b.json")")
  echo "run $i: no export ${a[-1]} ms, collector down ${b[-1]} ms"
done
python3 - "${a[*]}" "${b[*]}" <<'PY'
import statistics, sys
a = [float(x) for x in sys.argv[1].split()]
b = [float(x) for x in sys.argv[2].split()]
ma, mb = statistics.median(a), statistics.median(b)
print(f"median step: no export {ma:.2f} ms, collector down {mb:.2f} ms, ratio {mb/ma:.3f}")
print(f"fastest step run: no export {min(a):.2f} ms, collector down {min(b):.2f} ms, ratio {min(b)/min(a):.3f}")
PY
