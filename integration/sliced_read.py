"""Sliced-read throughput of the engine backends (Ray, Mooncake) against a memcpy of the same bytes.

``python -m knitkit.integration.sliced_read [--quick] [--json PATH]`` prints the table;
``benchmarks/transfer.py`` calls ``measure(engine, quick)`` for its
``sliced_read.<engine>.fraction_of_ceiling`` keys.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np

from knitkit.storage import UnitBackend, cp_chunks
from knitkit.types import UnitKey

ROUTING_ROW = (48, 8)
"""One token's MoE routing decisions: 48 layers x top-8 (uint8 expert ids)."""


def fraction_of_ceiling(
    backend: UnitBackend, *, num_units: int = 8, tokens: int = 16384, repeats: int = 7
) -> float:
    """Time of a memcpy of the same bytes / time of the backend's sliced reads (1.0 = at the ceiling).

    Stores ``num_units`` routing units ``[tokens, 48, 8]`` and reads, as CP rank 0 of 2 does,
    two of each unit's four chunks into one pre-touched destination (registered with the backend
    when it supports that, as a reorganizer's ring is); the ceiling copies the same row ranges
    from in-memory arrays into the same destination. Medians over ``repeats`` passes.
    """
    rng = np.random.default_rng(0)
    units = [rng.integers(0, 64, (tokens, *ROUTING_ROW), dtype=np.uint8) for _ in range(num_units)]
    keys = [UnitKey(f"sliced-read-{i}", "routing") for i in range(num_units)]
    for key, unit in zip(keys, units, strict=True):
        backend.put(key, unit)
    ranges = cp_chunks(tokens, 2, 0)
    rows = sum(stop - start for start, stop in ranges)
    dst = np.ones((num_units * rows, *ROUTING_ROW), dtype=np.uint8)
    for hook, arg in (("register", dst), ("resolve", keys)):
        if hasattr(backend, hook):
            getattr(backend, hook)(arg)

    def backend_pass() -> None:
        for i, key in enumerate(keys):
            backend.read(key, ranges, out=dst[i * rows : (i + 1) * rows])

    def memcpy_pass() -> None:
        for i, unit in enumerate(units):
            at = i * rows
            for start, stop in ranges:
                np.copyto(dst[at : at + stop - start], unit[start:stop])
                at += stop - start

    return _median_s(memcpy_pass, repeats) / _median_s(backend_pass, repeats)


def measure(engine: str, quick: bool = False) -> float:
    """``fraction_of_ceiling`` of ``engine`` ("ray" or "mooncake"), starting what it needs locally."""
    sizes = {"num_units": 4, "tokens": 4096, "repeats": 5} if quick else {}
    if engine == "ray":
        return _on_ray(lambda backend: fraction_of_ceiling(backend, **sizes))
    if engine == "mooncake":
        return _on_mooncake(lambda backend: fraction_of_ceiling(backend, **sizes))
    raise ValueError(f"unknown engine {engine!r}; choose 'ray' or 'mooncake'")


def _on_ray(run: Callable[[UnitBackend], float]) -> float:
    import ray
    from knitkit.integration.ray import RayBackend

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    backend = RayBackend()
    try:
        return run(backend)
    finally:
        backend.close()
        if started:
            ray.shutdown()


def _on_mooncake(run: Callable[[UnitBackend], float]) -> float:
    from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster

    with MooncakeMaster() as address:
        backend = MooncakeBackend(address, segment_bytes=256 << 20)
        try:
            return run(backend)
        finally:
            backend.close()


def _median_s(run: Callable[[], None], repeats: int) -> float:
    run()  # warm: first-touch faults, connections, lease lookups
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller units, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    parser.add_argument("--engines", nargs="+", default=["ray", "mooncake"])
    args = parser.parse_args(argv)
    figures = {f"sliced_read.{e}.fraction_of_ceiling": measure(e, args.quick) for e in args.engines}
    print(f"{'figure':<42} {'value':>8}")
    for name, value in figures.items():
        print(f"{name:<42} {value:>8.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
