"""knitkit.metrics: push the parts' ``metrics()`` snapshots to TensorBoard, JSON lines or any callable, per step.

Glue level: no part imports this package and it imports no part (see NOTE [ Parts are pulled,
observers are pushed ] in ``observer.py``). ``TensorBoardObserver`` needs ``knitkit[tensorboard]``
and imports it only when built.
"""

from knitkit.metrics.jsonl import JsonlObserver, read_jsonl
from knitkit.metrics.observer import PREFIX, FanOut, MetricsObserver, checked, merge, sum_over
from knitkit.metrics.progress import ProgressLine
from knitkit.metrics.tensorboard import TensorBoardObserver

__all__ = [
    "PREFIX",
    "FanOut",
    "JsonlObserver",
    "MetricsObserver",
    "ProgressLine",
    "TensorBoardObserver",
    "checked",
    "merge",
    "read_jsonl",
    "sum_over",
]
