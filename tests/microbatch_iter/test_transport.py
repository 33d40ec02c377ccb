"""make_transport: the CPU path uses neither pinning nor events; unknown devices are refused."""

from __future__ import annotations

import pytest
import torch

from knitkit.microbatch_iter import CpuTransport, make_transport


def test_cpu_transport_allocates_plain_host_memory_shared_with_the_device_side():
    """On CPU the staged host buffer is what the consumer reads (no pinning, no second copy)."""
    transport = make_transport(torch.device("cpu"), slots=2)
    assert isinstance(transport, CpuTransport)
    host = transport.new_host(128)
    assert host.dtype == torch.uint8 and host.device.type == "cpu"
    assert transport.new_device(128, host) is host
    for step in (transport.before_refill, transport.hand_over, transport.release):
        step(0)
    transport.close()


def test_unsupported_device_is_refused():
    """A device type with no transport raises and names the device."""
    with pytest.raises(ValueError, match="meta"):
        make_transport(torch.device("meta"), slots=2)
