"""A stand-in http model engine for the tests: a real process that records how it was started.

    python stub_engine.py --port PORT [ANY OTHER ARGS…]

Serves on 127.0.0.1:PORT what the node's http runtime drives (vLLM's flavour): ``GET
/health``, ``GET /is_sleeping``, ``POST /sleep``, ``POST /wake_up``, and answers a POST to any
other path with its own command line (``argv``), its ``CUDA_VISIBLE_DEVICES`` (``null`` when
unset) and the payload it got, so a test can check what the node passed to the engine.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

ARGV = sys.argv[1:]
PORT = int(ARGV[ARGV.index("--port") + 1])
STATE = {"sleeping": False}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {})
        elif self.path == "/is_sleeping":
            self._reply(200, {"is_sleeping": STATE["sleeping"]})
        else:
            self._reply(404, {"error": self.path})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path.startswith("/sleep"):
            STATE["sleeping"] = True
            self._reply(200, {})
        elif self.path == "/wake_up":
            STATE["sleeping"] = False
            self._reply(200, {})
        else:
            self._reply(
                200,
                {
                    "argv": ARGV,
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "payload": json.loads(body or b"{}"),
                    "pid": os.getpid(),
                },
            )

    def _reply(self, status: int, data: object) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: object) -> None:
        pass


HTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
