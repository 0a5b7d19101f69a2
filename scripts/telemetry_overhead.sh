#!/usr/bin/env bash
# Step time of a partitioned run with its OpenTelemetry collector up (scripts/otlp_sink.py,
# answering 200) against the same with the collector down (nothing listens) or answering
# HTTP 500 — export failures must not slow training. Runs are interleaved (up, down, 500,
# up, ...) so machine noise hits all alike; prints each run's median step time and the ratios
# of the medians and of the minima (noise on a shared machine only adds time, so the minima
# are the better estimate there). Usage: scripts/telemetry_overhead.sh [RUNS] [DATA]
set -euo pipefail
runs=${1:-6}
data=${2:-synthetic:nodes=100000,degree=10,features=64,classes=8,seed=1}
bin=${TRELLIS:-target/release/trellis}
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
python3 "$here/otlp_sink.py" 0 >"$tmp/sink.out" &
sink=$!
python3 - "$tmp/fail.port" <<'PY' &
import http.server, sys
class Fail(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fail)
open(sys.argv[1], "w").write(str(s.server_address[1]))
s.serve_forever()
PY
fail=$!
trap 'kill $sink $fail 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 50); do
  [[ -s "$tmp/sink.out" && -s "$tmp/fail.port" ]] && break
  sleep 0.1
done
up=$(awk '{print $3}' "$tmp/sink.out")
f500=$(cat "$tmp/fail.port")
step_ms() {
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['latency']['step']['p50_ms'])" "$1"
}
run() { # NAME ENDPOINT
  "$bin" train --data "$data" --partitions 2 --epochs 12 --report "$tmp/$1.json" \
    --otlp-endpoint "$2" >/dev/null 2>&1
  step_ms "$tmp/$1.json"
}
a=(); b=(); c=()
for i in $(seq "$runs"); do
  a+=("$(run up "http://127.0.0.1:$up")")
  # Port 9 (discard) on loopback: nothing listens, every export fails.
  b+=("$(run down http://127.0.0.1:9)")
  c+=("$(run e500 "http://127.0.0.1:$f500")")
  echo "run $i: collector up ${a[-1]} ms, down ${b[-1]} ms, HTTP 500 ${c[-1]} ms"
done
python3 - "${a[*]}" "${b[*]}" "${c[*]}" <<'PY'
import statistics, sys
up, down, e500 = ([float(x) for x in arg.split()] for arg in sys.argv[1:4])
for name, v in (("down", down), ("HTTP 500", e500)):
    print(f"collector {name}: median step {statistics.median(v):.2f} ms vs up "
          f"{statistics.median(up):.2f} ms (ratio {statistics.median(v)/statistics.median(up):.3f}); "
          f"fastest {min(v):.2f} vs {min(up):.2f} ms (ratio {min(v)/min(up):.3f})")
PY
