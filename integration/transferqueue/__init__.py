"""knitkit.integration.transferqueue."""

from .sampler import (
    AdmissionSampler,
    sampler_conf,
    trajectory_tags,
)
