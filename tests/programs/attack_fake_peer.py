"""An impostor at a job peer's address (stdlib only; run as another uid by the attack tests).

Usage: ``python attack_fake_peer.py HOST PORT LOG ANSWER_JSON``

Listens on HOST:PORT (a port another user took over, e.g. after the real peer's agent died),
appends every request it receives, raw, to LOG, and answers each with HTTP 200 and ANSWER_JSON
(a forged "I coordinate, your incident belongs in my trace" answer) plus a made-up proof header.
Prints ``ready`` once listening. Exits after 120 s.
"""

from __future__ import annotations

import socket
import sys
import threading
import time


def serve(conn: socket.socket, log: str, answer: bytes) -> None:
    conn.settimeout(10)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip() or 0)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        with open(log, "ab") as fh:
            fh.write(head + b"\r\n\r\n" + body + b"\n--\n")
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     b"x-servewatch-proof: %s\r\nconnection: close\r\n\r\n%s" % (len(answer), b"ab" * 32, answer))
    except OSError:
        pass
    finally:
        conn.close()


def main() -> int:
    host, port, log, answer = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].encode()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)
    srv.settimeout(1.0)
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        threading.Thread(target=serve, args=(conn, log, answer), daemon=True).start()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
