"""Independent reference code the tests compare diagnoser against: plain standard-library implementations, and
servers that misbehave on purpose."""

from __future__ import annotations


def union_us(intervals: list[tuple[float, float]], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Length of the union of [start, end) intervals clipped to [lo, hi]: busy time as a trace viewer would add it."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total


# An HTTP server (run with `python -c`) that answers every request, keep-alive included, with headers promising
# 10 MB and then one byte every 0.2 s: each read is well inside any socket timeout, so only a deadline on the whole
# answer ends it. It prints its port on the first line.
TRICKLE_SERVER = r"""
import socket, threading, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(16)
print(srv.getsockname()[1], flush=True)
def serve(conn):
    try:
        while True:
            if not conn.recv(65536):
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 10000000\r\n\r\n")
            while True:
                conn.sendall(b"#")
                time.sleep(0.2)
    except OSError:
        pass
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
