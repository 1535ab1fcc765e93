"""A /metrics endpoint whose label values change at every scrape (stdlib only, run as nobody).

Serves ``http://127.0.0.1:<port>/metrics`` with ``--series`` series of SGLang's progress counter
and busy gauge, each labelled with a value never seen before (a request id), growing counts.
Prints ``ready <port>`` and serves until killed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--series", type=int, default=4000)
    args = p.parse_args()
    ids = itertools.count()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            scrape = next(ids)
            lines = ["# TYPE sglang:generation_tokens_total counter"]
            lines += [f'sglang:generation_tokens_total{{request_id="r{scrape}-{i}"}} {scrape + i}' for i in range(args.series)]
            lines.append("# TYPE sglang:num_running_reqs gauge")
            lines += [f'sglang:num_running_reqs{{request_id="r{scrape}-{i}"}} 1' for i in range(args.series)]
            body = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print("ready", server.server_address[1], flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
