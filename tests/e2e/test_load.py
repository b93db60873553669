"""5,000 concurrent streaming connections through the gateway on loopback (``bench/commands/load.py``):
no errors, every stream open at once, and memory within a bound. Its figures (added latency,
memory, CPU) are printed; they are measurements, not pass/fail criteria. About 2 minutes."""

from __future__ import annotations

import pytest

from bench.commands.load import raise_fd_limit, report, run

CONNECTIONS = 5000


def test_five_thousand_concurrent_streams_through_the_gateway(tmp_path):
    try:
        raise_fd_limit(3 * CONNECTIONS + 1000)
    except RuntimeError as exc:
        pytest.skip(str(exc))
    # 250 new connections a second is what one gateway process sustains on a shared 2-core
    # machine (measured: 500/s saturates its core, and the added first-chunk p50 grows from
    # 3 ms to 100 ms); 40 one-second tokens keep the first streams open until the last start.
    result = run(CONNECTIONS, replicas=4, ramp_per_s=250, tokens=40, log_dir=tmp_path)
    print(report(result))
    for phase in ("direct", "gateway"):
        assert result[phase]["errors"] == 0, (phase, result[phase]["first_error"])
    assert result["gateway"]["most_open"] == CONNECTIONS
    # measured 214 MiB at the peak (52 MiB idle): about 32 KiB per stream, client and upstream
    # connection together; a bound well above it, that a leak per chunk or per request would pass
    assert result["gateway_memory_mib"]["peak"] < 600


async def test_the_gateways_bookkeeping_stays_within_its_bounds_over_a_long_replay(fleet, aiohttp_server):
    """Shadow indexes, branch statistics, conversation memory and change sites stay at or under
    their configured bounds while a replay keeps adding conversations (each bound well below
    what the replay would fill)."""
    from prefix_router.app import GATEWAY, create_app
    from prefix_router.config import config_from_dict
    from prefix_router.tools.replay.client import replay
    from prefix_router.tools.replay.generate import builtin_workload
    from prefix_router.prompts.tokenizer import ByteTokenizer

    from ..helpers import MODEL

    sims = await fleet(2)
    bounds = {"max_blocks_per_replica": 400, "max_branch_blocks": 300, "max_conversations": 20}
    config = config_from_dict({"replicas": [str(s.make_url("")).rstrip("/") for s in sims], "index": bounds,
                               "scrape": {"interval_s": 0.2}, "changes": {"max_sites": 5}})
    server = await aiohttp_server(create_app(config, ByteTokenizer()))
    gw = server.app[GATEWAY]
    seen = {"shadow": 0, "branches": 0, "conversations": 0, "change_sites": 0}
    requests = builtin_workload("breakers", sessions=120, seed=4)
    for start in range(0, len(requests), 100):  # in slices, checking the bounds between them
        records = await replay(requests[start:start + 100], str(server.make_url("")), model=MODEL, time_scale=500)
        assert all(r.error is None for r in records)
        seen["shadow"] = max(seen["shadow"], *(len(r.shadow) for r in gw.replicas.values()))
        seen["branches"] = max(seen["branches"], len(gw.branches))
        seen["conversations"] = max(seen["conversations"], len(gw.conversations))
        seen["change_sites"] = max(seen["change_sites"], len(gw.changes))
    print(f"{len(requests)} requests; most held: {seen} (bounds {bounds})")
    assert 0 < seen["shadow"] <= bounds["max_blocks_per_replica"]
    assert 0 < seen["branches"] <= bounds["max_branch_blocks"]
    assert seen["conversations"] == bounds["max_conversations"]  # filled, never past
    assert seen["change_sites"] == 5  # filled, never past; later changes counted by cause only
    assert sum(count for count, _ in gw.changes.by_cause.values()) > sum(s.count for s in gw.changes.sites.values())
    total_blocks = sum(r.shadow.capacity for r in gw.replicas.values())
    assert total_blocks == 2 * bounds["max_blocks_per_replica"]
