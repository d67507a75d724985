"""Fixtures of ``tests/ops``."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process: collectives that mutation testing's in-process runs can see."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
