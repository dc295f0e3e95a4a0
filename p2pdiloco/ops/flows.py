"""Plain TCP flows between testbed peers: what the links deliver to a transport that does nothing but send.

The benchmarks measure an all-reduce against the link bound 2·(N−1)/N·S/B; TCP itself never reaches B (headers,
slow start, queueing at the rate limiter), so they also time this calibration, in the same run: every peer sends
`size` bytes to every other peer at once, as a reduce-scatter does.

    python -m p2pdiloco.ops.flows serve PORT N_SENDERS     # prints "ready", returns once N senders are done
    python -m p2pdiloco.ops.flows send SIZE PORT ADDR...   # prints the seconds until every peer has it all

And what one warm connection carries both ways at once, as a libp2p connection between two peers must:

    python -m p2pdiloco.ops.flows duplex-serve PORT               # prints "ready"; serves one connection
    python -m p2pdiloco.ops.flows duplex SIZE TRIALS PORT ADDR    # prints each trial's seconds, 2 s apart
"""

from __future__ import annotations

import socket
import sys
import threading
import time

BLOCK = 1 << 20


def serve(port: int, senders: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(senders)
    print("ready", flush=True)
    threads = []
    for _ in range(senders):
        conn, _ = server.accept()
        threads.append(threading.Thread(target=_drain, args=(conn,)))
        threads[-1].start()
    for t in threads:
        t.join()


def _drain(conn: socket.socket) -> None:
    while conn.recv(BLOCK):
        pass
    conn.sendall(b"k")  # everything arrived: the sender's clock stops at this acknowledgement
    conn.close()


def send(size: int, port: int, addresses: list[str]) -> float:
    def one(address: str) -> None:
        conn = socket.create_connection((address, port), timeout=120)
        _send_all(conn, size)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        conn.close()

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(a,)) for a in addresses]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - started


def duplex_serve(port: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen(1)
    print("ready", flush=True)
    conn, _ = server.accept()
    with conn:
        while True:
            header = _recv_exact(conn, 8)  # the trial's size; none: the client is done
            if not header:
                return
            _both_ways(conn, int.from_bytes(header, "big"))
            conn.sendall(b"k")  # all of the client's bytes came: its trial's clock stops here


def duplex(size: int, trials: int, port: int, address: str, idle: float = 2.0) -> list[float]:
    seconds = []
    with socket.create_connection((address, port), timeout=120) as conn:
        for trial in range(trials):
            if trial:
                time.sleep(idle)
            started = time.monotonic()
            conn.sendall(size.to_bytes(8, "big"))
            _both_ways(conn, size)
            _recv_exact(conn, 1)
            seconds.append(time.monotonic() - started)
    return seconds


def _both_ways(conn: socket.socket, size: int) -> None:
    """Sends `size` bytes on a thread while receiving as many."""
    sender = threading.Thread(target=_send_all, args=(conn, size))
    sender.start()
    _recv_exact(conn, size)
    sender.join()


def _send_all(conn: socket.socket, size: int) -> None:
    block = b"x" * BLOCK
    for start in range(0, size, BLOCK):
        conn.sendall(block[: min(BLOCK, size - start)])


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = conn.recv(min(BLOCK, size - got))
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "duplex-serve":
        duplex_serve(int(sys.argv[2]))
    elif sys.argv[1] == "duplex":
        print(" ".join(f"{s:.4f}" for s in duplex(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])),
              flush=True)
    else:
        print(f"{send(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]):.4f}", flush=True)
