"""knitkit.integration.transferqueue."""

from .backend import TransferQueueBackend as TransferQueueBackend
from .backend import TransferQueueConnection as TransferQueueConnection
from .backend import start_transfer_queue as start_transfer_queue
from .backend import stop_transfer_queue as stop_transfer_queue
from .baseline import pack_streamed as pack_streamed
from .baseline import put_trajectories as put_trajectories
from .baseline import read_share_tq as read_share_tq
from .baseline import streaming_loader as streaming_loader
from .sampler import AdmissionSampler as AdmissionSampler
from .sampler import sampler_conf as sampler_conf
from .sampler import trajectory_tags as trajectory_tags
