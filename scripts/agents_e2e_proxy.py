"""A recording HTTP proxy for scripts/agents_e2e.sh: forwards every request to `pagedllm serve` unchanged and
appends the exchange to a JSON-lines file (method, path, status, request body, response body as streamed),
so the transcript shows exactly what each agent sent and what the server answered.

    python scripts/agents_e2e_proxy.py LISTEN_PORT UPSTREAM_URL LOG.jsonl
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding", "content-encoding"}


def make_handler(upstream: str, log_path: str):
    lock = threading.Lock()
    client = httpx.Client(timeout=httpx.Timeout(900, connect=10))

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes: streams pass through as sent

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            start = time.time()
            record = {"time": start, "method": self.command, "path": self.path,
                      "request": body.decode(errors="replace")}
            chunks: list[bytes] = []
            try:
                with client.stream(self.command, upstream + self.path, content=body, headers=headers) as r:
                    record["status"] = r.status_code
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in _HOP_HEADERS:
                            self.send_header(k, v)
                    self.end_headers()
                    for chunk in r.iter_raw():
                        chunks.append(chunk)
                        self.wfile.write(chunk)
                        self.wfile.flush()
            except (httpx.HTTPError, OSError) as e:  # the upstream went away or the client hung up
                record["error"] = f"{type(e).__name__}: {e}"
            record["response"] = b"".join(chunks).decode(errors="replace")
            record["seconds"] = round(time.time() - start, 3)
            with lock, open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

        do_GET = do_POST = do_DELETE = do_HEAD = _forward

        def log_message(self, *args) -> None:
            pass

    return Forward


def main() -> None:
    port, upstream, log_path = int(sys.argv[1]), sys.argv[2].rstrip("/"), sys.argv[3]
    ThreadingHTTPServer(("127.0.0.1", port), make_handler(upstream, log_path)).serve_forever()


if __name__ == "__main__":
    main()
