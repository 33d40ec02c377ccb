"""A reorganizer process's environment: its slot fills stream past the cache (NOTE [ Streaming fills ])."""

from __future__ import annotations

from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
NON_TEMPORAL_THRESHOLD = "glibc.cpu.x86_non_temporal_threshold"
FILL_THRESHOLD_BYTES = 256 << 10
"""Copies from this size on use non-temporal stores in a reorganizer process."""

# NOTE [ Streaming fills ]: a reorganizer writes each delivered byte once into a ring slot and
# never reads it again; a consumer in another process reads it later, after its own compute. A
# copy through the cache first reads every destination line it writes (for ownership) and leaves
# the slot in this core's cache, where nobody reads it; a non-temporal store does neither. glibc's
# memmove streams only copies above its non-temporal threshold, three quarters of the last-level
# cache it reports (190 MiB on the 2-core dev box, which reports 480 MiB; tens of MiB on a
# server), and a slot's copies (one field's rows of one trajectory chunk) never reach it: in
# benchmarks/transfer.py a step's backbone micro-batches take 272 copies, median 9 KiB, with 96%
# of the bytes in the 18% of 256 KiB or more (the MoE routing rows). So a reorganizer process
# starts with glibc's tunable lowered to FILL_THRESHOLD_BYTES, unless its launcher's environment
# sets that tunable itself (an explicit choice, kept); the small copies still go through the
# cache. Only x86 glibc reads the tunable; elsewhere it is ignored. Measured (benchmarks/README.md,
# transfer.py, issue 31 stop 52): the fills' CPU 10.0-10.9 -> 7.2-9.0 ms per step over 4 pairs,
# the reorganizers' 18.2-19.8 -> 14.9-17.8 ms. The consumer's read moves too (a scratch producer
# process filling 2.6 MiB slots, its consumer reading every byte): read right after the
# publication, it comes from memory instead of a cache, 129-144 -> 240-247 us, more than the
# fill saves (457-463 -> 379-392 us); read after ~5 ms of matmuls, as a look-ahead rank does,
# it is faster too, 322 -> 262-265 us (fill 553-575 -> 435-471 us). A Ray reorganizer actor runs
# in a Ray worker, whose environment Ray sets: not here.


def streaming_copies(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with glibc's non-temporal threshold set to ``FILL_THRESHOLD_BYTES``, added to
    the ``GLIBC_TUNABLES`` it already has; unchanged where that tunable is set already."""
    tunables = environ.get(TUNABLES, "")
    if any(item.partition("=")[0] == NON_TEMPORAL_THRESHOLD for item in tunables.split(":")):
        return dict(environ)
    ours = f"{NON_TEMPORAL_THRESHOLD}={FILL_THRESHOLD_BYTES:#x}"
    return {**environ, TUNABLES: f"{tunables}:{ours}" if tunables else ours}
