"""Pin a Ray actor or task to one node: the scheduling strategy every knitkit actor uses."""

from __future__ import annotations

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def pinned_to(node_id: str) -> NodeAffinitySchedulingStrategy:
    """Run on node ``node_id`` or not at all (``soft=False``): a relay, reorganizer or unit
    directory elsewhere would read or own its node's rings and units from the wrong node."""
    return NodeAffinitySchedulingStrategy(node_id, soft=False)
