"""Sliced-read throughput of the engine backends (Ray, Mooncake) against a ceiling moving the same bytes.

``python -m knitkit.integration.sliced_read [--quick] [--json PATH]`` prints the table;
``benchmarks/transfer.py`` calls ``measure_engines(engines, quick)`` for its
``sliced_read.<engine>.fraction_of_ceiling`` keys (against a memcpy of the same bytes, as for
every other backend; plus Mooncake's ``fraction_of_ceiling_over_transport``,
``fraction_of_whole_unit_transport`` and ``fraction_of_transport``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np

from knitkit.storage import UnitBackend
from knitkit.storage.planning import cp_chunks
from knitkit.types import UnitKey, UnitRead

ROUTING_ROW = (48, 8)
"""One token's MoE routing decisions: 48 layers x top-8 (uint8 expert ids)."""


def fraction_of_ceiling(
    backend: UnitBackend,
    *,
    num_units: int = 8,
    tokens: int = 16384,
    repeats: int = 7,
    ceiling: str = "memcpy",
) -> float:
    """Time of the ceiling moving the same bytes / time of the backend's sliced reads (1.0 = at
    the ceiling).

    Stores ``num_units`` routing units ``[tokens, 48, 8]`` and reads, as CP rank 0 of 2 does,
    two of each unit's four chunks into one pre-touched destination (registered with the backend
    when it supports that, as a reorganizer's ring is), all units in one ``read_many``. The
    ceiling: ``"memcpy"`` copies the same row ranges from in-memory arrays into the same
    destination; ``"whole_units"`` (a backend behind a transport) reads, in one ``read_many``
    through the same backend, whole units holding exactly the bytes the sliced pass moves, so
    the figure is what slicing costs on top of the transport's own rate. Medians over
    ``repeats`` alternating passes.
    """
    keys, units = _store_units(backend, num_units, tokens)
    ranges = cp_chunks(tokens, 2, 0)
    rows = sum(stop - start for start, stop in ranges)
    dst = _destination(backend, keys, num_units * rows)
    if ceiling == "whole_units":
        compact, _ = _store_units(backend, num_units, rows, prefix="sliced-read-ceiling")
        reads = [UnitRead(key) for key in compact]
        outs = [dst[i * rows : (i + 1) * rows] for i in range(num_units)]
        return time_ratio(
            lambda: backend.read_many(reads, outs), _sliced_pass(backend, keys, dst), repeats
        )
    if ceiling != "memcpy":
        raise ValueError(f"unknown ceiling {ceiling!r}; choose 'memcpy' or 'whole_units'")

    def memcpy_pass() -> None:
        for i, unit in enumerate(units):
            at = i * rows
            for start, stop in ranges:
                np.copyto(dst[at : at + stop - start], unit[start:stop])
                at += stop - start

    return time_ratio(memcpy_pass, _sliced_pass(backend, keys, dst), repeats)


def fraction_of_transport(
    writer: UnitBackend,
    reader: UnitBackend,
    *,
    num_units: int = 8,
    tokens: int = 16384,
    repeats: int = 7,
) -> float:
    """Whole-unit read time per byte / sliced read time per byte, both through ``reader``.

    For a backend whose reads cross a transport (Mooncake's TCP here), this separates the cost
    of slicing from the transport's own rate: 1.0 means ranges move as fast as whole units.
    """
    keys, _ = _store_units(writer, num_units, tokens)
    dst = _destination(reader, keys, num_units * tokens)
    rows = sum(stop - start for start, stop in cp_chunks(tokens, 2, 0))

    reads = [UnitRead(key) for key in keys]
    outs = [dst[i * tokens : (i + 1) * tokens] for i in range(len(keys))]

    def whole_pass() -> None:
        reader.read_many(reads, outs)

    return time_ratio(whole_pass, _sliced_pass(reader, keys, dst), repeats) * rows / tokens


def measure(engine: str, quick: bool = False) -> dict[str, float]:
    """The ``sliced_read.<engine>.*`` figures of ``engine`` ("ray" or "mooncake"), starting what it
    needs locally: ``fraction_of_ceiling`` (against a memcpy of the same bytes, the ceiling of
    every backend). For Mooncake that figure reads through the owner, whose own segment holds
    the units (a same-process copy, see NOTE [ Mooncake same-process reads ]); the others read
    through a memory-less client, over the transport as any other process or host does:
    ``fraction_of_ceiling_over_transport`` (against the same memcpy),
    ``fraction_of_whole_unit_transport`` (against whole-unit reads of exactly the same bytes over
    the transport) and ``fraction_of_transport``."""
    units, tokens, repeats = (4, 8192, 5) if quick else (8, 16384, 7)
    sizes = {"num_units": units, "tokens": tokens, "repeats": repeats}

    def ceiling(backend: UnitBackend, kind: str) -> float:
        return fraction_of_ceiling(
            backend, num_units=units, tokens=tokens, repeats=repeats, ceiling=kind
        )

    prefix = f"sliced_read.{engine}"
    if engine == "ray":
        return {f"{prefix}.fraction_of_ceiling": _on_ray(lambda b: ceiling(b, "memcpy"))}
    if engine == "mooncake":
        return {
            f"{prefix}.fraction_of_ceiling": _on_mooncake(lambda b, _: ceiling(b, "memcpy")),
            f"{prefix}.fraction_of_ceiling_over_transport": _on_mooncake(
                lambda _, reader: ceiling(reader, "memcpy")
            ),
            f"{prefix}.fraction_of_whole_unit_transport": _on_mooncake(
                lambda _, reader: ceiling(reader, "whole_units")
            ),
            f"{prefix}.fraction_of_transport": _on_mooncake(
                lambda b, reader: fraction_of_transport(b, reader, **sizes)
            ),
        }
    raise ValueError(f"unknown engine {engine!r}; choose 'ray' or 'mooncake'")


ENGINE_MODULES = {"ray": ("ray",), "mooncake": ("mooncake.engine", "mooncake.store")}
"""The modules each engine's backend loads; an engine whose modules do not import is skipped."""


def unavailable(engine: str) -> str | None:
    """Why ``engine`` cannot run here (its wheel or a system library it links is missing), or
    ``None`` when its modules load."""
    for module in ENGINE_MODULES[engine]:
        try:
            importlib.import_module(module)
        except (ImportError, OSError) as error:
            return (
                f"{engine} cannot load ({module}: {error}); install it (./dev.sh test installs "
                "the engines and, as root, the system libraries they link)"
            )
    return None


def measure_engines(
    engines: list[str], quick: bool = False
) -> tuple[dict[str, float], dict[str, str]]:
    """The figures of every engine in ``engines`` that loads, and for each one that does not,
    ``sliced_read.<engine>.skipped``: the reason (said on stdout too)."""
    figures: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for engine in engines:
        if engine not in ENGINE_MODULES:
            raise ValueError(f"unknown engine {engine!r}; choose from {sorted(ENGINE_MODULES)}")
        reason = unavailable(engine)
        if reason is None:
            figures.update(measure(engine, quick))
        else:
            skipped[f"sliced_read.{engine}.skipped"] = reason
            print(f"sliced reads on {engine}: skipped, {reason}", flush=True)
    return figures, skipped


def _store_units(
    backend: UnitBackend, num_units: int, tokens: int, prefix: str = "sliced-read"
) -> tuple[list[UnitKey], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    units = [rng.integers(0, 64, (tokens, *ROUTING_ROW), dtype=np.uint8) for _ in range(num_units)]
    keys = [UnitKey(f"{prefix}-{i}", "routing") for i in range(num_units)]
    for key, unit in zip(keys, units, strict=True):
        backend.put(key, unit)
    return keys, units


def _destination(backend: UnitBackend, keys: list[UnitKey], rows: int) -> np.ndarray:
    """A pre-touched destination, registered and with ``keys`` resolved where the backend can."""
    dst = np.ones((rows, *ROUTING_ROW), dtype=np.uint8)
    for hook, arg in (("register", dst), ("resolve", keys)):
        if hasattr(backend, hook):
            getattr(backend, hook)(arg)
    return dst


def _sliced_pass(backend: UnitBackend, keys: list[UnitKey], dst: np.ndarray) -> Callable[[], None]:
    """Read CP rank 0's two chunks (of 2 ranks) of every unit, back to back into ``dst``, in one
    ``read_many`` call as a reorganizer reads a micro-batch."""
    tokens = backend.spec(keys[0]).shape[0]
    ranges = cp_chunks(tokens, 2, 0)
    rows = sum(stop - start for start, stop in ranges)
    reads = [UnitRead(key, ranges) for key in keys]
    outs = [dst[i * rows : (i + 1) * rows] for i in range(len(keys))]
    return lambda: backend.read_many(reads, outs)


def _on_ray(run: Callable[[UnitBackend], float]) -> float:
    import ray

    from knitkit.integration.ray import RayBackend, start_ray

    started = not ray.is_initialized()
    if started:
        start_ray(num_cpus=2, logging_level=logging.ERROR)
    backend = RayBackend()
    try:
        return run(backend)
    finally:
        backend.close()
        if started:
            ray.shutdown()


def _on_mooncake(run: Callable[[UnitBackend, UnitBackend], float]) -> float:
    """``run(owner, reader)``: the owner holds the units (and reads them out of its own segment);
    the reader contributes no memory, so its reads go through the transport as those of a
    reorganizer process or a reader on another host do."""
    from knitkit.integration.mooncake import MooncakeBackend, MooncakeMaster

    with MooncakeMaster() as address:
        # one node, loopback: opt in to Mooncake's wildcard listeners (its README, "Listeners")
        owner = MooncakeBackend(address, segment_bytes=256 << 20, allow_wildcard_listeners=True)
        reader = MooncakeBackend(
            address, namespace=owner.namespace, segment_bytes=0, allow_wildcard_listeners=True
        )
        try:
            return run(owner, reader)
        finally:
            reader.close()
            owner.close()


def time_ratio(baseline: Callable[[], None], measured: Callable[[], None], repeats: int) -> float:
    """Median time of ``baseline`` / median time of ``measured``, run alternately (after one
    warm-up each: first-touch faults, connections, lease lookups) so load drifts hit both."""
    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(repeats + 1):
        for run, out in ((baseline, times[0]), (measured, times[1])):
            start = time.perf_counter()
            run()
            if round_:
                out.append(time.perf_counter() - start)
    return statistics.median(times[0]) / statistics.median(times[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller units, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one flat JSON object")
    parser.add_argument("--engines", nargs="+", default=["ray", "mooncake"])
    args = parser.parse_args(argv)
    figures, skipped = measure_engines(args.engines, args.quick)
    print(f"{'figure':<56} {'value':>8}")
    for name, value in figures.items():
        print(f"{name:<56} {value:>8.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**figures, **skipped}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
