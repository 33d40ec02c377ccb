"""knitkit is a guest in the trainer's process: it leaves process-wide state as it found it (issue 19).

Each test runs a scenario in a fresh Python process and checks, from outside or from the
process's own final report, the state a trainer shares with knitkit: signal handlers, the
garbage collector, the environment, and the atexit handlers the trainer registered first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

RUN_S = 240.0
"""Bound of one scenario process (spawned reorganizers, a Ray start on a loaded machine)."""

_STATE = """
import atexit, gc, json, os, signal, sys, threading

def state():
    handlers = {}
    for sig in sorted(signal.valid_signals()):
        try:
            handlers[str(int(sig))] = repr(signal.getsignal(sig))
        except (OSError, ValueError):
            continue
    return {
        "signals": handlers,
        "gc": {"enabled": repr(gc.isenabled()), "threshold": repr(gc.get_threshold())},
        "env": dict(os.environ),
        "hooks": {"sys": repr(sys.excepthook), "threading": repr(threading.excepthook)},
    }
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``python -c`` (spawned children do not re-run it) and ``args``."""
    return _finish(_start(script, *args))


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    """Start ``script`` as ``_run`` runs it, to overlap another scenario (``_finish`` it)."""
    code = _STATE + textwrap.dedent(script)
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    """Wait (``RUN_S``) for a started scenario; past the bound it is killed and that raised."""
    try:
        stdout, stderr = process.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _report(done: subprocess.CompletedProcess[str], tag: str = "REPORT") -> Any:
    """The JSON a scenario printed on its last line starting with ``tag``."""
    lines = [line for line in done.stdout.splitlines() if line.startswith(tag + " ")]
    assert lines, f"no {tag} (status {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix(tag + " "))


_EVERY_PART = """
atexit.register(lambda: print("EARLY ATEXIT RAN", flush=True))
with_ray = sys.argv[1] == "ray"
before = state()

import knitkit.admission, knitkit.encoder_dedup
from knitkit.integration.ray import start_ray
from knitkit.microbatch_iter import MicroBatchIterator
from knitkit.storage import (
    MicroBatchConsumer, PlannerConfig, ReorganizerProcess, RingSpec, SharedMemoryBackend,
    Topology, TrajectoryStore, plan_minibatch,
)
from knitkit.storage.baselines import synthetic_trajectories
imported = state()
ray_imported = "ray" in sys.modules

store = TrajectoryStore(SharedMemoryBackend(slab_bytes=8 << 20))
for trajectory in synthetic_trajectories(2, group_size=2):
    store.write(trajectory)
config = PlannerConfig(token_fields=("tokens", "logprobs", "loss_mask"), max_tokens_per_micro_batch=256)
plan = store.register(plan_minibatch(store.metas(), Topology(dp=1, cp=1, tp=1), config, minibatch_id="mb0"))
group = plan.consumer(0, 0)
spec = RingSpec.new(num_slots=2, slot_bytes=1 << 20, num_consumers=1)
with ReorganizerProcess(store.backend, spec) as reorganizer:
    reorganizer.submit("mb0", group)
    reorganizer.finish(timeout_s=0)
    with MicroBatchConsumer(spec, 0) as consumer, MicroBatchIterator(consumer) as batches:
        delivered = sum(1 for _ in batches)
store.consumed("mb0", group.name)
store.backend.close()

cluster_flag = None
if with_ray:
    import ray
    from ray._private import ray_constants
    flag = ray_constants.ENABLE_RAY_CLUSTER
    start_ray(num_cpus=1, logging_level="ERROR")
    assert ray.get(ray.remote(lambda: 7).remote()) == 7
    ray.shutdown()
    cluster_flag = [flag, ray_constants.ENABLE_RAY_CLUSTER]

threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("knitkit"))
after = state()
print("REPORT " + json.dumps({
    "before": before, "imported": imported, "after": after, "ray_imported": ray_imported,
    "delivered": delivered, "expected": len(group.micro_batches), "threads": threads,
    "cluster_flag": cluster_flag,
}), flush=True)
"""

_BARE_RAY = """
before = state()
import ray
ray.init(
    address="local", num_cpus=1, logging_level="ERROR", include_dashboard=False,
    log_to_driver=False, dashboard_host="127.0.0.1", _node_ip_address="127.0.0.1",
)
assert ray.get(ray.remote(lambda: 7).remote()) == 7
ray.shutdown()
print("REPORT " + json.dumps({"before": before, "after": state()}), flush=True)
"""


def _delta(before: dict, after: dict) -> dict[str, dict[str, list]]:
    """What changed between two ``state()`` reports, per section (handler addresses dropped)."""
    out: dict[str, dict[str, list]] = {}
    for section in ("signals", "gc", "env", "hooks"):
        old, new = before[section], after[section]
        out[section] = {
            k: [_plain(old.get(k)), _plain(new.get(k))]
            for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)
        }
    return out


def _plain(value: str | None) -> str | None:
    return None if value is None else re.sub(r" at 0x[0-9a-f]+", "", value)


@pytest.mark.slow
@pytest.mark.parametrize("ray", ["no-ray", "ray"])
def test_every_part_leaves_the_process_as_it_found_it(ray):
    """A fresh process registers an atexit handler, then imports every part and uses the store,
    the planner, a reorganizer process, a consumer, the iterator and (with Ray) ``start_ray``.
    Importing knitkit changes nothing (and does not import Ray). After everything is closed no
    knitkit thread is left, and the signal handlers, the collector's state and thresholds, the
    exception hooks and the environment are what they were; with Ray, they changed exactly as a
    bare ``ray.init`` with the same options changes them in a fresh process (Ray's own SIGTERM
    handler and variables), and Ray's cluster constant is back. At exit the trainer's earlier
    atexit handler runs and the status is 0."""
    if ray == "ray":
        pytest.importorskip("ray")
        bare_ray = _start(_BARE_RAY)  # its own local runtime, beside the scenario's
    done = _run(_EVERY_PART, ray)
    report = _report(done)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("EARLY ATEXIT RAN"), done.stdout[-2000:]
    assert report["delivered"] == report["expected"] > 0
    before, imported, after = report["before"], report["imported"], report["after"]
    assert imported == before, "importing knitkit changed process state"
    assert not report["ray_imported"], "importing knitkit.integration.ray imported Ray"
    assert report["threads"] == []
    if ray == "no-ray":
        assert after == before
        return
    flag_before, flag_after = report["cluster_flag"]
    assert flag_after == flag_before
    bare = _report(_finish(bare_ray))
    assert _delta(before, after) == _delta(bare["before"], bare["after"])


_BUSY_SOURCE_AT_EXIT = """
atexit.register(lambda: print("EARLY ATEXIT RAN", flush=True))
import torch
from knitkit.microbatch_iter import MicroBatchIterator

def source():
    yield {"tokens": torch.arange(8)}
    a = torch.ones(256, 256)
    while True:  # a collate that is busy in torch when the training loop ends
        a = torch.mm(a, a).clamp_(max=1.0)

batches = MicroBatchIterator(source(), MicroBatchIterator.Config(join_timeout_s=1.0))
next(batches)
print("TOOK ONE", flush=True)
"""


@pytest.mark.slow
def test_exit_with_a_busy_prefetch_source_runs_the_trainers_atexit_handlers():
    """The training loop ends (without closing its iterator) while the prefetch thread is busy in
    torch inside the source: the atexit handler the trainer registered before importing knitkit
    (a logger flush, ``wandb.finish``, a checkpoint writer) still runs, and the status is 0."""
    done = _run(_BUSY_SOURCE_AT_EXIT)
    assert "TOOK ONE" in done.stdout, done.stderr[-4000:]
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("EARLY ATEXIT RAN"), done.stdout[-2000:]


_SIGTERM = """
import time
from knitkit.storage import MemoryBackend, ReorganizerProcess, RingSpec

def name(handler):
    if handler in (signal.SIG_DFL, signal.SIG_IGN):
        return signal.Handlers(handler).name
    return "host" if handler is host else ("host2" if handler is host2 else "knitkit")

def open_one():
    return ReorganizerProcess(MemoryBackend(), RingSpec.new(num_slots=1, slot_bytes=4096, num_consumers=1))

calls = []
def host(signum, frame):
    calls.append("host")
previous = []
def host2(signum, frame):  # installed after knitkit's; chains to the handler it replaced
    calls.append("host2")
    if callable(previous[0]):
        previous[0](signum, frame)

seen = []
scenario = sys.argv[1]
if scenario == "default":  # SIG_DFL; reorganizers opened and closed in several orders
    a, b, c = open_one(), open_one(), open_one()
    seen.append(name(signal.getsignal(signal.SIGTERM)))
    b.close(); seen.append(name(signal.getsignal(signal.SIGTERM)))
    a.close(); seen.append(name(signal.getsignal(signal.SIGTERM)))
    c.close(); seen.append(name(signal.getsignal(signal.SIGTERM)))
    a, b = open_one(), open_one()
    a.close(); b.close(); seen.append(name(signal.getsignal(signal.SIGTERM)))
elif scenario == "ignored":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open_one(), open_one():
        seen.append(name(signal.getsignal(signal.SIGTERM)))
        signal.raise_signal(signal.SIGTERM)
    seen.append(name(signal.getsignal(signal.SIGTERM)))
elif scenario == "host-before":
    signal.signal(signal.SIGTERM, host)
    with open_one():
        seen.append(name(signal.getsignal(signal.SIGTERM)))
        signal.raise_signal(signal.SIGTERM)
    seen.append(name(signal.getsignal(signal.SIGTERM)))
elif scenario == "host-after":  # installed while one is open, still there after it closed
    with open_one():
        previous.append(signal.signal(signal.SIGTERM, host2))
    seen.append(name(signal.getsignal(signal.SIGTERM)))
    signal.raise_signal(signal.SIGTERM)  # host2, then knitkit's: nothing of ours is open
    seen.append(name(signal.getsignal(signal.SIGTERM)))
elif scenario == "host-after-while-open":  # knitkit's ends the process after the host's ran
    with open_one() as reorganizer:
        previous.append(signal.signal(signal.SIGTERM, host2))
        print("RING " + reorganizer.spec.name, flush=True)
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            print("CALLS " + json.dumps(calls), flush=True)
elif scenario == "closed-elsewhere":  # last close off the main thread: the handler stays,
    reorganizer = open_one()            # and acts as the SIG_DFL it replaced
    closer = threading.Thread(target=reorganizer.close)
    closer.start(); closer.join()
    print("REPORT " + json.dumps({"seen": [], "calls": calls}), flush=True)
    signal.raise_signal(signal.SIGTERM)
    time.sleep(30)
print("REPORT " + json.dumps({"seen": seen, "calls": calls}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scenario", "seen", "calls"),
    [
        ("default", ["knitkit", "knitkit", "knitkit", "SIG_DFL", "SIG_DFL"], []),
        ("ignored", ["SIG_IGN", "SIG_IGN"], []),
        ("host-before", ["host", "host"], ["host"]),
        ("host-after", ["host2", "host2"], ["host2"]),
    ],
)
def test_sigterm_handling_is_restored_and_never_skips_the_hosts(scenario, seen, calls):
    """While a ReorganizerProcess is open SIGTERM becomes a clean exit only where it was SIG_DFL;
    the last close (in any order) restores SIG_DFL; SIG_IGN and a handler the trainer installed
    before stay installed and run alone; a handler installed after knitkit's is left in place
    after the last close, and when it chains to knitkit's with nothing open the process
    continues (it does not exit)."""
    done = _run(_SIGTERM, scenario)
    report = _report(done)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (report["seen"], report["calls"]) == (seen, calls)


@pytest.mark.slow
def test_sigterm_after_a_later_host_handler_still_cleans_up():
    """A handler the trainer installs after knitkit's and that chains to it runs first; then
    knitkit's ends the process (status 143) through every close: the ring is unlinked."""
    done = _run(_SIGTERM, "host-after-while-open")
    assert done.returncode == 143, (done.returncode, done.stderr[-4000:])
    ring = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("RING "))
    assert _report(done, "CALLS") == ["host2"]
    assert not os.path.exists(f"/dev/shm/{ring}")


@pytest.mark.slow
def test_sigterm_handler_left_behind_acts_as_the_default():
    """If the last reorganizer closes off the main thread (knitkit cannot restore the handler
    there), a SIGTERM delivered later ends the process by the signal, as SIG_DFL would."""
    done = _run(_SIGTERM, "closed-elsewhere")
    _report(done)
    assert done.returncode == -15, (done.returncode, done.stderr[-4000:])


_PLANNING_THREADS = """
import time
sys.setswitchinterval(1e-5)  # many thread switches: planners interleave at every step
from knitkit.storage.planning import planner as planner_module
from knitkit.storage import PlannerConfig, Topology, plan_minibatch
from knitkit.storage.baselines import synthetic_metas

inside = 0
count_lock = threading.Lock()
collections_while_planning = 0
started_with = 0
real_plan = planner_module._plan

def collections():
    return sum(generation["collections"] for generation in gc.get_stats())

# Collections are counted from the collector's own totals, read under the lock as the first
# planner goes in and the last comes out: a gc.callbacks hook read `inside` after the collection
# had started, and a thread switch at the hook's entry let a planner go in first (a collection
# that started while none planned, counted as one while planning).
def counted(*args, **kwargs):  # the real planner, counted while it runs
    global inside, started_with, collections_while_planning
    with count_lock:
        if inside == 0:
            started_with = collections()
        inside += 1
    try:
        return real_plan(*args, **kwargs)
    finally:
        with count_lock:
            inside -= 1
            if inside == 0:
                collections_while_planning += collections() - started_with

planner_module._plan = counted
if sys.argv[1] == "disabled":
    gc.disable()
before = gc.isenabled()
metas = synthetic_metas(256, group_size=4, max_tokens=8192)
config = PlannerConfig(max_tokens_per_micro_batch=8192)
barrier = threading.Barrier(4)

def plan_many():
    barrier.wait()
    for _ in range(12):
        plan_minibatch(metas, Topology(dp=4, cp=2, tp=1), config)

threads = [threading.Thread(target=plan_many) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("REPORT " + json.dumps({
    "before": before, "after": gc.isenabled(), "collections": collections_while_planning,
}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("collector", ["enabled", "disabled"])
def test_planning_threads_keep_the_collector_paused_and_restore_it(collector):
    """Four threads plan at once, many times, with frequent thread switches: no automatic
    collection runs while any of them is inside the planner (the pause is process-wide), and
    afterwards the collector is as it was before (on stays on, a user's off stays off)."""
    done = _run(_PLANNING_THREADS, collector)
    report = _report(done)
    assert done.returncode == 0, done.stderr[-4000:]
    assert report["after"] == report["before"] == (collector == "enabled")
    assert report["collections"] == 0
