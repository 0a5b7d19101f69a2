#!/usr/bin/env python3
"""A stand-in OpenTelemetry collector for measurements: answers every OTLP/HTTP export
(POST /v1/traces, /v1/metrics) with 200 and an empty protobuf response, and counts them.
Usage: scripts/otlp_sink.py PORT  (prints `listening on PORT` once ready)."""
import http.server
import sys


class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink)
print(f"listening on {server.server_address[1]}", flush=True)
server.serve_forever()
