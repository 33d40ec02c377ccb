"""Run on simulated nodes: ``serve ADDRESS PORT`` receives one stream and prints its bytes and
seconds (first byte to last); ``send ADDRESS PORT NBYTES`` sends that many bytes to it."""

from __future__ import annotations

import socket
import sys
import time


def serve(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        print("listening", flush=True)
        server.settimeout(120)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(120)
            received = len(connection.recv(1 << 20))
            start = time.monotonic()
            while chunk := connection.recv(1 << 20):
                received += len(chunk)
            print(received, time.monotonic() - start, flush=True)


def send(address: str, port: int, nbytes: int) -> None:
    with socket.create_connection((address, port), timeout=120) as connection:
        connection.sendall(bytes(nbytes))


if __name__ == "__main__":
    mode, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    serve(address, port) if mode == "serve" else send(address, port, int(sys.argv[4]))
