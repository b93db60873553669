"""Fixtures shared by the gateway tests: simulated replicas in the test's event loop."""

from __future__ import annotations

import pytest

from prefix_router.tools.sim.config import SimConfig
from prefix_router.tools.sim.server import create_app as create_sim
from prefix_router.prompts.tokenizer import ByteTokenizer

from .helpers import MODEL


@pytest.fixture
async def fleet(aiohttp_server):
    """``await fleet(n, **SimConfig fields)``: start ``n`` simulated replicas; returns their servers."""

    async def start(n: int = 2, **sim):
        cfg = dict(model=MODEL, num_gpu_blocks=20_000, max_model_len=100_000, time_scale=1000.0)
        cfg.update(sim)
        return [await aiohttp_server(create_sim(SimConfig(**cfg), ByteTokenizer())) for _ in range(n)]

    return start
