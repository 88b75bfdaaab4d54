"""A simulated link between processes on one machine, for benchmarks/split_links.py (not in the
product path): a TCP relay that forwards each connection accepted on a listening port to a
target address and writes every chunk it reads, in either direction, to the other side
`latency` seconds after it arrived (one-way latency), in order, and no faster than `bandwidth`
bytes/s where one is given. The kernel here has no netem qdisc, so the delay is made in user
space: a reader and a writer thread per direction; the writer sleeps until a chunk is due and
spins the last 0.2 ms (a sleep alone overshoots by ~0.1 ms, as much as the shortest link)."""

import argparse
import collections
import socket
import threading
import time
from typing import Dict, Optional, Tuple

SPIN = 2e-4  # seconds before a chunk is due that the writer spins instead of sleeping


def wait_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > SPIN:
        time.sleep(remaining - SPIN)
    while time.perf_counter() < deadline:
        pass


def pump(source: socket.socket, sink: socket.socket, latency: float, bandwidth: Optional[float]) -> None:
    """Forward source -> sink with the link's latency and bandwidth until source closes."""
    chunks: collections.deque = collections.deque()
    ready = threading.Condition()
    done = [False]

    def read():
        while True:
            try:
                data = source.recv(1 << 20)
            except OSError:
                data = b""
            with ready:
                if not data:
                    done[0] = True
                else:
                    chunks.append((time.perf_counter() + latency, data))
                ready.notify()
            if not data:
                return

    def write():
        free_at = 0.0  # when the link has sent what it was given (the bandwidth cap)
        while True:
            with ready:
                while not chunks and not done[0]:
                    ready.wait()
                if not chunks:
                    break
                due, data = chunks.popleft()
            if bandwidth:
                free_at = max(free_at, due - latency) + len(data) / bandwidth
                due = max(due, free_at + latency)
            wait_until(due)
            try:
                sink.sendall(data)
            except OSError:
                break
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=write, daemon=True).start()


def connect(address: Tuple[str, int], timeout: float = 120.0) -> socket.socket:
    """A connection to `address`, retried until it listens (a rank may not listen yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def serve(routes: Dict[int, Tuple[str, int]], latency: float, bandwidth: Optional[float] = None) -> None:
    """Listen on 127.0.0.1 at each port of `routes` and relay what connects to its address."""
    listeners = []
    for port, address in routes.items():
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(16)
        listeners.append((listener, address))

    def accept(listener, address):
        while True:
            downstream, _ = listener.accept()
            downstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream = connect(address)
            pump(downstream, upstream, latency, bandwidth)
            pump(upstream, downstream, latency, bandwidth)

    threads = [threading.Thread(target=accept, args=pair, daemon=True) for pair in listeners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", action="append", required=True, help="LISTEN_PORT:HOST:PORT (repeatable)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0, help="cap in Mbit/s (0: none)")
    args = parser.parse_args()
    routes = {}
    for route in args.route:
        port, host, target = route.split(":")
        routes[int(port)] = (host, int(target))
    bandwidth = args.bandwidth_mbps * 1e6 / 8 if args.bandwidth_mbps else None
    serve(routes, args.latency_ms / 1e3, bandwidth)


if __name__ == "__main__":
    main()
