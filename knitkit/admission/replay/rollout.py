"""The simulated rollout side: issue queue, rollout slots, per-token versions, partial rollout."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from knitkit.admission.replay.trace import Trace, TraceRecord
from knitkit.types import TrajectoryMeta


@dataclass(slots=True)
class Job:
    """One trajectory being rolled out; its tokens are split into segments by generating version."""

    record: TraceRecord
    trajectory_id: str
    rollout_step: int
    remaining_s: float
    version: int
    """Version generating its tokens now (set when it starts or resumes)."""
    run_from: float = 0.0
    """When generation (re)started, after any resume penalty."""
    segments: list[tuple[int, float]] = field(default_factory=list)
    """(version, seconds of generation) of the finished segments."""
    ticket: int = 0
    """Bumped on every interruption so stale FINISH events are ignored."""

    def close_segment(self, now: float) -> None:
        done = min(max(0.0, now - self.run_from), self.remaining_s)
        if done > 0:
            self.segments.append((self.version, done))
            self.remaining_s -= done

    def meta(self) -> TrajectoryMeta:
        versions = [v for v, _ in self.segments] or [self.version]
        return TrajectoryMeta(
            trajectory_id=self.trajectory_id,
            sample_id=self.record.sample_id,
            source=self.record.source,
            rollout_step=self.rollout_step,
            num_tokens=self.record.tokens if self.record.tokens is not None else 1,
            min_version=min(versions),
            max_version=max(versions),
            accepted=self.record.accepted,
        )


class EventQueue:
    """Time-ordered events; ties broken by insertion order so runs are deterministic."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.now = 0.0

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), action))

    def run_until(self, done: Callable[[], bool]) -> None:
        while self._heap and not done():
            time, _, action = heapq.heappop(self._heap)
            self.now = max(self.now, time)
            action()


class RolloutPool:
    """Rollout slots fed from a FIFO issue queue; the k-th issue of a source replays trace record k."""

    def __init__(
        self, trace: Trace, slots: int, events: EventQueue, on_finish: Callable[[Job], None]
    ):
        self._trace = trace
        self._next = dict.fromkeys(trace.sources, 0)
        self.slots = slots
        self.events = events
        self.queue: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self._on_finish = on_finish
        self._outstanding: Counter[str] = Counter()
        self.version = 0

    def outstanding(self, source: str) -> int:
        """Issued trajectories of ``source`` not yet finished (queued or running)."""
        return self._outstanding[source]

    def issue(self, step: int, prompts: Mapping[str, int], interleave: bool = True) -> int:
        """Queue ``prompts[source]`` GRPO groups per source; returns the trajectories queued.

        ``interleave`` alternates sources round-robin; otherwise sources are queued whole, in
        the order of ``prompts`` (e.g. slowest first).
        """
        g = self._trace.group_size
        order = (
            [
                s
                for r in range(max(prompts.values(), default=0))
                for s, c in prompts.items()
                if r < c
            ]
            if interleave
            else [s for s, c in prompts.items() for _ in range(c)]
        )
        for source in order:
            records = self._trace.records[source]
            start = self._next[source]
            if start + g > len(records):
                raise RuntimeError(f"trace source {source!r} ran out of records at {start}")
            self._next[source] = start + g
            for k in range(start, start + g):
                rec = records[k]
                self.queue.append(Job(rec, f"{source}#{k}", step, rec.duration_s, self.version))
            self._outstanding[source] += g
        return len(order) * g

    def fill(self, penalty_s: float = 0.0) -> None:
        """Start queued jobs while slots are free; resumed partial jobs pay ``penalty_s``."""
        now = self.events.now
        while self.queue and len(self.running) < self.slots:
            job = self.queue.popleft()
            job.version = self.version
            job.run_from = now + (penalty_s if job.segments else 0.0)
            self._start(job)

    def _start(self, job: Job) -> None:
        self.running[job.trajectory_id] = job
        self.events.at(job.run_from + job.remaining_s, self._finisher(job))

    def _finisher(self, job: Job) -> Callable[[], None]:
        ticket = job.ticket
        return lambda: self._finish(job, ticket)

    def _finish(self, job: Job, ticket: int) -> None:
        if job.ticket != ticket or job.trajectory_id not in self.running:
            return
        del self.running[job.trajectory_id]
        self._outstanding[job.record.source] -= 1
        job.close_segment(self.events.now)
        job.remaining_s = 0.0
        self._on_finish(job)

    def resume_at_new_version(self, penalty_s: float) -> None:
        """Abort-resume at a sync: cut every running job; the rest of its tokens use the new version."""
        now = self.events.now
        for job in self.running.values():
            job.close_segment(now)
            job.ticket += 1
            job.version = self.version
            job.run_from = now + penalty_s
            self.events.at(job.run_from + job.remaining_s, self._finisher(job))

    def pause_all(self) -> None:
        """Stop every running job (colocated phase end); partial jobs resume first next phase."""
        now = self.events.now
        paused = list(self.running.values())
        for job in paused:
            job.close_segment(now)
            job.ticket += 1
        self.running.clear()
        self.queue.extendleft(reversed(paused))

    def drop_running(self) -> int:
        """Discard every running job (no partial rollout); returns how many were dropped."""
        dropped = len(self.running)
        for job in self.running.values():
            job.ticket += 1
            self._outstanding[job.record.source] -= 1
        self.running.clear()
        return dropped
