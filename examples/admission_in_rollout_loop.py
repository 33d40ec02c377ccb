"""Admission alone, in a rollout loop: admit quota-meeting mini-batches as trajectories complete.

Four sources share each train batch 25% each; "video" rollouts are slow. Streaming admission
would fill early mini-batches with fast sources and miss the video quota; knittrans keeps slots
for it (feasibility guards) while still admitting mini-batches before the train batch completes.

Run: python examples/admission_in_rollout_loop.py
"""

import random
from collections import Counter

from knitkit.admission import SourceQuota, build_controller
from knitkit.types import TrajectoryMeta

SOURCES = {"math": 1.0, "code": 1.5, "chart": 2.0, "video": 6.0}  # mean rollout seconds
GROUP, TRAIN_BATCH = 4, 32  # GRPO n=4; 8 prompts per train batch


def rollout_completions(rng: random.Random, steps: int):
    """(finish time, trajectory) for 3 prompts per source per rollout step (over-sampling)."""
    events = []
    for step in range(steps):
        for source, mean in SOURCES.items():
            for p in range(3):
                sample = f"{source}-{step}-{p}"
                for k in range(GROUP):
                    done = step * 4.0 + rng.expovariate(1 / mean)
                    events.append(
                        (
                            done,
                            TrajectoryMeta(f"{sample}-{k}", sample, source, step, 1024, step, step),
                        )
                    )
    return sorted(events, key=lambda e: e[0])


for policy in ("streaming", "knittrans"):
    controller = build_controller(
        policy,
        train_batch_size=TRAIN_BATCH,
        num_minibatches=4,
        sources=tuple(SOURCES),
        quotas=[SourceQuota(source=s, min_ratio=0.25) for s in SOURCES],
        group_size=GROUP,
    )
    mix: Counter[str] = Counter()
    for when, meta in rollout_completions(random.Random(0), steps=2):
        controller.report(meta)
        while (minibatch := controller.next_minibatch()) is not None:
            mix.update(t.source for t in minibatch.trajectories)  # train on it here
            if minibatch.index == 3:  # the train batch is complete: sync weights here
                met = all(mix[s] >= TRAIN_BATCH // 4 for s in SOURCES)
                print(
                    f"{policy:>9} train batch {minibatch.train_batch} at t={when:5.1f}s "
                    f"mix={dict(mix)} quotas {'met' if met else 'VIOLATED'}"
                )
                mix.clear()
