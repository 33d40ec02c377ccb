"""knitkit.integration.transferqueue."""

from .sampler import AdmissionSampler as AdmissionSampler
from .sampler import sampler_conf as sampler_conf
from .sampler import trajectory_tags as trajectory_tags
