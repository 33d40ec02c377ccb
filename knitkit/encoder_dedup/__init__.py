"""Multimodal encoder dedup (paper 5.3): encode each unique unit once per mini-batch, keep its graph,
route detached rows to every consumer, return owned gradient rows, run one deferred encoder backward.
"""

from knitkit.encoder_dedup.agreement import RouteMismatch
from knitkit.encoder_dedup.assignment import (
    BackboneAssignment,
    EncoderAssignment,
    RowSlice,
    row_slices,
)
from knitkit.encoder_dedup.bridge import feature_slices, route_minibatch
from knitkit.encoder_dedup.dedup import DedupEncoder, EncodeFn, Phase
from knitkit.encoder_dedup.grad_sync import sync_encoder_grads
from knitkit.encoder_dedup.minibatch import BackboneStep, train_minibatch
from knitkit.encoder_dedup.ordering import DeferredBackward, FinalizeWithDeferredBackward
from knitkit.encoder_dedup.plan import Exchange, RankRoute, RoutingPlan, build_routing_plan
from knitkit.encoder_dedup.transport import LocalTransport, ProcessGroupTransport, RowTransport

__all__ = [
    "BackboneAssignment",
    "BackboneStep",
    "DedupEncoder",
    "DeferredBackward",
    "EncodeFn",
    "EncoderAssignment",
    "Exchange",
    "FinalizeWithDeferredBackward",
    "LocalTransport",
    "Phase",
    "ProcessGroupTransport",
    "RankRoute",
    "RouteMismatch",
    "RoutingPlan",
    "RowSlice",
    "RowTransport",
    "build_routing_plan",
    "feature_slices",
    "route_minibatch",
    "row_slices",
    "sync_encoder_grads",
    "train_minibatch",
]
