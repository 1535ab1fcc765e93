"""Requests to the agent API from a local user (stdlib only, run as nobody).

Sends ``--count`` requests, each on a new connection, from rotating 127/8 source addresses
(``--rotate``) or 127.0.0.1, with a guessed bearer token (``guess-<i>``) or the one in
``--token-file``; prints the JSON ``{"status code": count}`` (``"error"``: no answer).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--method", default="GET")
    p.add_argument("--path", default="/v1/status")
    p.add_argument("--token-file")
    p.add_argument("--rotate", action="store_true")
    p.add_argument("--interval", type=float, default=0.0, help="seconds between requests")
    p.add_argument("--body", action="store_true", help='print {"status": counts, "body": the last body}')
    args = p.parse_args()
    token = None
    if args.token_file:
        with open(args.token_file) as fh:
            token = fh.read().strip()
    counts: dict[str, int] = {}
    body = ""
    for i in range(1, args.count + 1):
        source = (f"127.{(i >> 16) & 255}.{(i >> 8) & 255}.{max(1, i & 255)}", 0) if args.rotate else None
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=10, source_address=source)
        headers = {"authorization": f"Bearer {token if token else f'guess-{i:06d}'}", "connection": "close"}
        payload = b"{}" if args.method == "POST" else None
        if payload is not None:
            headers["content-type"] = "application/json"
        try:
            conn.request(args.method, args.path, body=payload, headers=headers)
            response = conn.getresponse()
            status = str(response.status)
            body = response.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            status = "error"
        finally:
            conn.close()
        counts[status] = counts.get(status, 0) + 1
        if args.interval:
            time.sleep(args.interval)
    print(json.dumps({"status": counts, "body": body} if args.body else counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
