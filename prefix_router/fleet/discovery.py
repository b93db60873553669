"""Replica discovery by DNS: the A/AAAA records of one name are the replicas.

In Kubernetes that name is a headless Service in front of the vLLM pods
(``vllm.<namespace>.svc.cluster.local``): it resolves to the IP of every ready pod. Every
``discovery.interval_s`` the gateway resolves it; each address becomes the replica
``{scheme}://{address}:{port}`` (IPv6 in brackets), named ``address:port``.

- A new address joins the ring after its first ``/metrics`` scrape, which also reads its
  block size and KV capacity (``Gateway.add_replica``).
- An address gone from the records gets no new requests at once; its in-flight requests run
  on, and its state is forgotten ``drain_s`` later once they have finished
  (``Gateway.apply_discovery``, ``Gateway.forget_drained``). One that comes back before that
  keeps its shadow index.
- A failed lookup (a resolver timeout, NXDOMAIN while every pod is being replaced) changes
  nothing: keeping the last known set beats emptying the ring on a DNS blip.
- Static replicas from the ``replicas`` list are never touched.
- ``prefill_dns`` names a disaggregated fleet's prefill replicas the same way (their role
  ``prefill``); ``dns`` then names its decode replicas.

Several gateway instances each resolve on their own. The ring depends only on the set of
replica names (``prefix_router/routing/ring.py``), not on the order they were found in, so instances place a
request's key on the same replica as soon as their lookups agree (within one interval).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from prefix_router.config import DiscoveryConfig
from prefix_router.gateway import Gateway

__all__ = ["resolve", "replica_urls", "discover_once", "poll_dns"]

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[set[str]]]


async def resolve(name: str, port: int) -> set[str]:
    """The addresses ``name`` resolves to (A and AAAA, the system resolver).

    Raises ``OSError`` (``socket.gaierror``) when the lookup fails.
    """
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return {info[4][0] for info in infos}


def replica_urls(addresses: set[str], config: DiscoveryConfig) -> list[str]:
    """Base URLs for ``addresses``, sorted (IPv6 in brackets)."""
    urls = []
    for address in sorted(addresses):
        host = f"[{address}]" if ipaddress.ip_address(address.split("%")[0]).version == 6 else address
        urls.append(f"{config.scheme}://{host}:{config.port}")
    return urls


async def discover_once(gw: Gateway, config: DiscoveryConfig, resolver: Resolver = resolve) -> bool:
    """Resolve ``config.dns`` and ``config.prefill_dns`` once and apply the result; False (and
    nothing changed) when a lookup failed or took longer than ``interval_s`` (at least 1 s)."""
    names = {role: name for role, name in (("both", config.dns), ("prefill", config.prefill_dns)) if name}
    found: dict[str, str] = {}
    for role, name in names.items():
        try:
            addresses = await asyncio.wait_for(resolver(name, config.port), timeout=max(config.interval_s, 1.0))
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("discovery: resolving %s failed (%s); keeping the %d known replicas",
                        name, exc or type(exc).__name__, len(gw.replicas))
            return False
        found.update(dict.fromkeys(replica_urls(addresses, config), role))
    added, drained = gw.apply_discovery(found, time.monotonic())
    for name in added:
        log.info("discovery: replica %s found (%s); on the ring after its first scrape", name,
                 gw.replicas[name].config.role)
    for name in drained:
        log.info("discovery: replica %s gone from %s; draining", name, " and ".join(names.values()))
    return True


async def poll_dns(gw: Gateway, config: DiscoveryConfig, resolver: Resolver = resolve) -> None:
    """``discover_once`` every ``config.interval_s`` forever."""
    while True:
        await asyncio.sleep(config.interval_s)
        await discover_once(gw, config, resolver)
