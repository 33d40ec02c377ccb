"""The simulated feeder: issues each rollout step's prompts, and dynamic-sampling top-ups when
rejected groups leave the open train batch unable to fill."""

from __future__ import annotations

import math
from collections import Counter

from knitkit.admission.controller import AdmissionController
from knitkit.admission.replay.rollout import RolloutPool
from knitkit.admission.replay.settings import ReplaySettings
from knitkit.admission.replay.trace import Trace
from knitkit.types import TrajectoryMeta

MIN_ACCEPT_RATE = 0.1
"""A top-up divides a source's missing trajectories by its acceptance rate, floored here."""

# NOTE [ Dynamic sampling ]: DAPO-style trainers filter GRPO groups whose rewards are all equal
# and keep generating within the step until the batch can fill, up to a bound
# (verl's ``max_num_gen_batches``). Without it the replay deadlocked whenever one rollout step's
# accepted groups could not feed the quotas (step k+1 is only issued once train batch k is
# full). The feeder models it: after every loss (a rejected or stale report) it asks the
# controller what the open train batch lacks even if everything pending and in flight were
# accepted (``AdmissionController.shortfall``). Only when that is not empty (the batch can no
# longer fill from what is out) does it issue a round into the same rollout step, sized to
# what is missing once in-flight work is discounted by each source's acceptance rate so far:
# each short source's missing trajectories divided by its rate (at least MIN_ACCEPT_RATE), in
# whole groups, within its outstanding cap; a size shortfall goes by issue share to the sources
# whose upper bound (in whole groups) leaves room (``Shortfall.open_sources``), those under
# their outstanding cap first. So a run that can fill never issues more than before, and a
# round covers the rejections still to come. At most ``dynamic_sampling_rounds`` rounds per
# step; when they are spent, the stall message names the source that ran short.


class Feeder:
    """Issues rollout steps into the pool and reports their sizes to the controller."""

    def __init__(
        self,
        trace: Trace,
        settings: ReplaySettings,
        pool: RolloutPool,
        ctl: AdmissionController,
    ) -> None:
        self.trace, self.settings, self.pool, self.ctl = trace, settings, pool, ctl
        self.shares = settings.issue_shares or dict.fromkeys(
            trace.sources, 1.0 / len(trace.sources)
        )
        self.step = -1
        self.rounds = 0
        """Dynamic-sampling rounds issued in the current step."""
        self.completed: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self._losses = 0

    def want(self, source: str) -> int:
        """GRPO groups of ``source`` one rollout step issues."""
        s = self.settings
        return round(
            (1 + s.oversample)
            * s.train_batch_size
            * self.shares.get(source, 0.0)
            / self.trace.group_size
        )

    def room(self, source: str) -> int:
        """Groups ``source`` may still issue under its outstanding cap (ready units count)."""
        g = self.trace.group_size
        cap = math.ceil(self.settings.source_cap * self.want(source)) * g
        held = self.pool.outstanding(source) + self.ctl.ready_counts().get(source, 0)
        return -(-(cap - held) // g)

    def issue_step(self, step: int) -> None:
        """Top each source up to one step's issue, counting ready and in-flight leftovers."""
        self.step, self.rounds = step, 0
        ready = self.ctl.ready_counts()
        prompts = {}
        for source in self.trace.sources:
            held = (self.pool.outstanding(source) + ready.get(source, 0)) // self.trace.group_size
            # A step tops a source up to its per-step issue, counting the ready leftovers of
            # earlier steps; adding a full step on top of them lets the ready pool (and
            # staleness) grow with run length whenever the cap is looser than one step.
            prompts[source] = max(0, min(self.want(source) - held, self.room(source)))
        self._issue(prompts)
        self.top_up(force=True)

    def _issue(self, prompts: dict[str, int]) -> None:
        if self.settings.issue_order == "slow_first":
            prompts = dict(sorted(prompts.items(), key=lambda kv: -self.trace.mean_duration(kv[0])))
        count = self.pool.issue(
            self.step, prompts, interleave=self.settings.issue_order == "round_robin"
        )
        self.ctl.issued(self.step, count)

    def reported(self, meta: TrajectoryMeta) -> None:
        self.completed[meta.source] += 1
        self.accepted[meta.source] += meta.accepted

    def rate(self, source: str) -> float:
        done = self.completed[source]
        return 1.0 if done == 0 else max(MIN_ACCEPT_RATE, self.accepted[source] / done)

    def top_up(self, force: bool = False) -> None:
        """Issue one dynamic-sampling round if losses (or, with ``force``, the step's own issue)
        left the open train batch short (NOTE [ Dynamic sampling ])."""
        stats = self.ctl.stats
        losses = stats.rejected + stats.stale_dropped + stats.discarded
        if losses == self._losses and not force:
            return
        self._losses = losses
        if (
            self.rounds >= self.settings.dynamic_sampling_rounds
            or self.ctl.train_batch != self.step
        ):
            return
        in_flight = {s: self.pool.outstanding(s) for s in self.trace.sources}
        if not self.ctl.shortfall(in_flight):
            return  # even if everything in flight is accepted it can fill: wait and see
        short = self.ctl.shortfall({s: int(n * self.rate(s)) for s, n in in_flight.items()})
        g = self.trace.group_size
        missing = {s: n / self.rate(s) for s, n in short.per_source.items()}
        # The size shortfall goes to sources its upper bounds leave room for, those under their
        # outstanding cap first (one at its cap issues nothing, and the batch would stall).
        open_sources = [s for s in short.open_sources if self.room(s) > 0] or list(
            short.open_sources
        )
        weight = sum(self.shares.get(s, 0.0) for s in open_sources) or 1.0
        for source in open_sources:
            share = self.shares.get(source, 0.0) / weight
            missing[source] = missing.get(source, 0.0) + short.any_source * share / self.rate(
                source
            )
        prompts = {
            s: max(0, min(math.ceil(n / g - 1e-9), self.room(s)))
            for s, n in missing.items()
            if n > 0
        }
        if sum(prompts.values()):
            self.rounds += 1
            self._issue(prompts)

    def why_stalled(self) -> str:
        """What kept the open train batch from filling, naming each short source or quota."""
        ctl, s = self.ctl, self.settings
        in_flight = {src: self.pool.outstanding(src) for src in self.trace.sources}
        short = ctl.shortfall(in_flight)
        lost = {
            src: self.completed[src] - self.accepted[src]
            for src in self.trace.sources
            if self.completed[src] > self.accepted[src]
        }
        parts = [
            f"quota {src!r} ran short by {n} trajectories"
            + (f" ({lost[src]} of its {self.completed[src]} were rejected)" if src in lost else "")
            for src, n in short.per_source.items()
        ]
        if short.any_source:
            parts.append(f"the train batch lacks {short.any_source} trajectories from any source")
        if not parts:
            parts.append("every quota could still be fed, yet no mini-batch was admitted")
        advice = []
        if ctl.stats.stale_dropped:
            advice.append(
                f"{ctl.stats.stale_dropped} trajectories went stale (max_staleness="
                f"{s.max_staleness}): raise --max-staleness"
            )
        if lost and self.rounds >= s.dynamic_sampling_rounds:
            advice.append(
                f"{self.rounds} dynamic-sampling rounds were spent in rollout step {self.step}: "
                f"raise --dynamic-sampling-rounds"
            )
        g = self.trace.group_size
        bounds = {q.source: q.bounds(s.train_batch_size)[0] for q in s.quotas()}
        thin = [src for src in short.per_source if self.want(src) * g < bounds.get(src, 0)]
        if thin:
            advice.append(
                f"{thin} are issued fewer trajectories per rollout step than their quota needs: "
                f"raise their issue share (--issue-shares) or --oversample"
            )
        capped = [src for src in short.per_source if src not in thin and self.room(src) <= 0]
        if short.any_source and all(self.room(src) <= 0 for src in short.open_sources):
            capped = list(short.open_sources)
        if capped:
            advice.append(f"{capped} are at their outstanding cap: raise --source-cap")
        advice.append("raise --oversample or the short source's issue share (--issue-shares)")
        return "; ".join(parts) + ". " + "; ".join(advice)
