"""Multimodal encoder dedup (paper 5.3): encode each unique unit once per mini-batch, keep its graph,
route detached rows to every consumer, return owned gradient rows, run one deferred encoder backward.
"""

from knitkit.encoder_dedup.agreement import Heard, PeerFailed, RouteMismatch, agree, tell_all
from knitkit.encoder_dedup.assignment import (
    BackboneAssignment,
    EncoderAssignment,
    RowSlice,
    row_slices,
)
from knitkit.encoder_dedup.bridge import feature_slices, route_minibatch, route_rank
from knitkit.encoder_dedup.dedup import DedupEncoder, EncodeFn, Folded, Phase
from knitkit.encoder_dedup.grad_sync import sync_encoder_grads
from knitkit.encoder_dedup.minibatch import BackboneStep, train_minibatch
from knitkit.encoder_dedup.ordering import DeferredBackward, FinalizeWithDeferredBackward
from knitkit.encoder_dedup.plan import (
    Exchange,
    RankRoute,
    RoutingPlan,
    build_rank_route,
    build_routing_plan,
)
from knitkit.encoder_dedup.segments import segment_ids
from knitkit.encoder_dedup.testing import (
    Comparison,
    EquivalenceError,
    EquivalenceReport,
    Tolerance,
    check_dedup_equivalence,
)
from knitkit.encoder_dedup.transport import LocalTransport, ProcessGroupTransport, RowTransport

__all__ = [
    "BackboneAssignment",
    "BackboneStep",
    "Comparison",
    "DedupEncoder",
    "DeferredBackward",
    "EncodeFn",
    "EncoderAssignment",
    "EquivalenceError",
    "EquivalenceReport",
    "Exchange",
    "FinalizeWithDeferredBackward",
    "Folded",
    "Heard",
    "LocalTransport",
    "PeerFailed",
    "Phase",
    "ProcessGroupTransport",
    "RankRoute",
    "RouteMismatch",
    "RoutingPlan",
    "RowSlice",
    "RowTransport",
    "Tolerance",
    "agree",
    "build_rank_route",
    "build_routing_plan",
    "check_dedup_equivalence",
    "feature_slices",
    "route_minibatch",
    "route_rank",
    "row_slices",
    "segment_ids",
    "sync_encoder_grads",
    "tell_all",
    "train_minibatch",
]
