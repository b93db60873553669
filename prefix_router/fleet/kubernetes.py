"""Replica discovery through the Kubernetes API: the pods a label selector matches, each a replica
while it is Ready and not terminating (``discovery.kubernetes``).

Where DNS (``discovery.py``) learns of a pod only once its headless Service publishes it and of
its end only at the next lookup, the API tells at once, and tells more: labels (the pod's role in
a disaggregated fleet, ``role_label``) and annotations (its data-parallel ranks, each a replica;
its KV-event ports: ``target``). The loop (``PodWatcher.run``), as the API's own
documentation asks of a client (https://kubernetes.io/docs/reference/using-api/api-concepts/):

1. LIST the namespace's pods matching the selector; every pod that takes traffic (``target``)
   becomes a replica, every other discovered replica starts draining (``Gateway.apply_discovery``).
   A failed LIST changes nothing: a partial or empty view never removes replicas.
2. WATCH from the list's resourceVersion with bookmarks, for ``resync_s`` (the server closes the
   stream then), applying each event: a pod made Ready joins, one made unready, terminating
   (``deletionTimestamp``) or DELETED (also: relabelled out of the selector) leaves.
3. LIST again after each watch window (the resync), and at once after a ``410 Gone`` (its
   resourceVersion too old), whether the server sends it as an ERROR event or an HTTP status.

A watch cut mid-stream resumes at once from the last resourceVersion it saw. Errors (the API
unreachable, 401/403, a second 410 in a row, a second cut) back off from 1 s to 30 s, keeping
the replicas known. A
pod that joins is health-checked and scraped at once, so it takes traffic within a second rather
than at the next round of checks. The readiness rule is llm-d's (``pkg/epp/util/pod/pod.go``:
not terminating, condition Ready "True"), plus an IP. Credentials: the pod's service account in a
cluster, else a kubeconfig; the Role it needs is ``get``, ``list`` and ``watch`` on pods
(``deploy/kubernetes/components/pod-discovery/gateway-rbac.yaml``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import time
from pathlib import Path

import aiohttp

from prefix_router.config import ConfigError, KubernetesConfig, ReplicaConfig
from prefix_router.constants import (DP_SIZE_ANNOTATION, KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION,
                                     MAX_DATA_PARALLEL_SIZE)
from prefix_router.fleet.replicas import check_all, scrape_once
from prefix_router.gateway import Gateway

__all__ = ["PodWatcher", "ROLES", "connect", "namespace_of", "target"]

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_MAX_BACKOFF_S = 30.0


def target(pod: dict, config: KubernetesConfig) -> ReplicaConfig | None:
    """The replica configuration of a pod (its JSON object, as the API sends it) that takes
    traffic: an IP, no ``deletionTimestamp``, condition Ready "True"; None otherwise.

    Read from the pod: its role from the ``role_label`` label (``both`` when absent or not one
    of ``ROLES``), its data-parallel ranks from the ``DP_SIZE_ANNOTATION`` annotation, its
    KV-event ports from ``KV_EVENTS_PORT_ANNOTATION`` and ``KV_EVENTS_REPLAY_PORT_ANNOTATION``
    (``prefix_router/constants.py``). An annotation that is not a number in range is ignored,
    with a warning: the pod is served as one replica, its events found through
    ``/kv_event_sources``."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp"):
        return None
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()):
        return None
    try:
        host = f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return None
    role = (meta.get("labels") or {}).get(config.role_label, "both")
    notes = meta.get("annotations") or {}
    name = meta.get("name", "?")
    size = _number(notes, DP_SIZE_ANNOTATION, MAX_DATA_PARALLEL_SIZE, name) or 1
    port, replay = (_number(notes, key, 65535, name) for key in (KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION))
    return ReplicaConfig(url=f"http://{host}:{config.port}", role=role if role in ROLES else "both",
                         data_parallel_size=size, kv_events=f"tcp://{host}:{port}" if port else None,
                         kv_events_replay=f"tcp://{host}:{replay}" if port and replay else None)


_warned: set[tuple[str, str, str]] = set()


def _number(notes: dict, key: str, high: int, pod: str) -> int | None:
    """Annotation ``key``'s value as an integer in 1..``high``; None when absent or not one
    (warned once a pod and value)."""
    value = notes.get(key)
    if value is None:
        return None
    text = str(value).strip()
    if len(text) <= 6 and text.isascii() and text.isdigit() and 1 <= int(text) <= high:
        return int(text)
    text = text[:40]
    if (pod, key, text) not in _warned:
        if len(_warned) >= 10_000:  # pods come and go: a bound, not a history
            _warned.clear()
        _warned.add((pod, key, text))
        log.warning("kubernetes: pod %s: annotation %s=%r is not a number from 1 to %d; ignored", pod, key,
                    text, high)
    return None


class PodWatcher:
    """Keeps the gateway's discovered replicas equal to the pods that take traffic (module
    docstring) in ``namespace``. ``api``: a ``kubernetes_asyncio`` ``ApiClient`` (``connect``)."""

    def __init__(self, gw: Gateway, config: KubernetesConfig, namespace: str, api) -> None:
        from kubernetes_asyncio import client

        self.gw, self.config, self.namespace = gw, config, namespace
        self.v1 = client.CoreV1Api(api)
        self.pods: dict[str, ReplicaConfig] = {}  # pod name -> its replica, those taking traffic
        self.probes: set[asyncio.Task] = set()  # new replicas' first checks, held until they end
        self.seen: str | None = None  # the last resourceVersion the watch saw

    def _apply(self) -> None:
        added, drained = self.gw.apply_discovery({rc.url: rc for rc in self.pods.values()}, time.monotonic())
        servers: dict[str, list[str]] = {}  # a server's new members, probed together
        for name in added:
            servers.setdefault(self.gw.replicas[name].url, []).append(name)
        for url, names in servers.items():
            log.info("kubernetes: pod at %s ready (%s%s); health-checked and scraped now", url,
                     self.gw.replicas[names[0]].config.role, "" if len(names) == 1 else f", {len(names)} ranks")
            task = asyncio.get_running_loop().create_task(self._probe(names))
            self.probes.add(task)
            task.add_done_callback(self.probes.discard)
        for name in drained:
            log.info("kubernetes: replica %s no longer ready or gone; draining", name)

    async def _probe(self, names: list[str]) -> None:
        """A new server's health check and scrape, at once, for all its ranks: on the ring
        within a second."""
        group = [self.gw.replicas[n] for n in names if n in self.gw.replicas]
        if not group or self.gw.http is None:
            return
        await check_all(self.gw.http, group, self.gw.config.health)
        await scrape_once(self.gw.http, group, 2.0)
        self.gw.sync_ring()

    def on_event(self, kind: str, pod: dict) -> None:
        """One watch event (``ADDED``, ``MODIFIED``, ``DELETED``) about ``pod``'s JSON object."""
        name = (pod.get("metadata") or {}).get("name")
        if not name:
            return
        found = target(pod, self.config) if kind != "DELETED" else None
        if found is None:
            if self.pods.pop(name, None) is not None:
                self._apply()
        elif self.pods.get(name) != found:
            self.pods[name] = found
            self._apply()

    async def list(self) -> str:
        """LIST the pods and make them the replicas; their resourceVersion, to watch from. Raises
        what the client raises (``ApiException`` for an error status), changing nothing then."""
        v1 = self.v1
        listed = await v1.list_namespaced_pod(self.namespace, label_selector=self.config.label_selector,
                                              _request_timeout=aiohttp.ClientTimeout(total=10))
        found = {}
        for item in listed.items or ():
            pod = v1.api_client.sanitize_for_serialization(item)  # the JSON object, as events carry it
            name, t = (pod.get("metadata") or {}).get("name"), target(pod, self.config)
            if name and t is not None:
                found[name] = t
        self.pods = found
        self._apply()
        return listed.metadata.resource_version

    async def watch(self, resource_version: str) -> str:
        """WATCH from ``resource_version`` for one window (``resync_s``); the last resourceVersion
        seen. Raises ``ApiException`` (410: too old; the caller lists again)."""
        from kubernetes_asyncio import watch

        window = max(int(self.config.resync_s), 1)
        stream = watch.Watch()
        self.seen = resource_version
        try:
            async for event in stream.stream(self.v1.list_namespaced_pod, self.namespace,
                                             label_selector=self.config.label_selector,
                                             resource_version=resource_version, allow_watch_bookmarks=True,
                                             timeout_seconds=window,
                                             _request_timeout=aiohttp.ClientTimeout(sock_read=window + 30)):
                if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self.on_event(event["type"], event.get("raw_object") or {})
        finally:
            self.seen = stream.resource_version or resource_version  # where a cut watch resumes
            await stream.close()
        return self.seen

    async def run(self, version: str | None = None) -> None:
        """LIST (unless ``version``, a LIST's, is given), WATCH a window, again, forever (module
        docstring)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        backoff, gone, cut = 1.0, False, False
        while True:
            try:
                if version is None:
                    version = await self.list()
                    backoff = 1.0
                await self.watch(version)
                version, gone, cut = None, False, False  # the window ended: resync, at once
                continue
            except ApiException as exc:
                if exc.status == 410 and not gone:  # too old a resourceVersion: list again at once
                    version, gone = None, True
                    continue
                log.warning("kubernetes: the API answered %s %s; keeping the %d replicas known", exc.status,
                            exc.reason, len(self.pods))
            except Exception as exc:  # noqa: BLE001 (connection errors, timeouts, a body the client cannot read)
                if not cut and self.seen is not None:  # a watch cut mid-stream: resume where it was, at once
                    version, cut = self.seen, True
                    continue
                log.warning("kubernetes: %s (%s); keeping the %d replicas known", type(exc).__name__,
                            str(exc)[:200], len(self.pods))
            version, cut = None, False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)


def namespace_of(config: KubernetesConfig, context: str | None = None) -> str:
    """The namespace to watch: the configured one, else the kubeconfig context's (``context``,
    when a kubeconfig gave the credentials), else the gateway pod's own (its service account's),
    else ``default``."""
    if config.namespace or context:
        return config.namespace or context
    with contextlib.suppress(OSError):
        return _NAMESPACE_FILE.read_text().strip() or "default"
    return "default"


async def connect(config: KubernetesConfig):
    """(an ``ApiClient``, the kubeconfig context's namespace or None): the pod's in-cluster
    credentials (``KUBERNETES_SERVICE_HOST`` set and no ``kubeconfig`` configured), else a
    kubeconfig's (``kubeconfig``, ``$KUBECONFIG``, ``~/.kube/config``). Raises ``ConfigError``
    naming the setting when ``kubernetes_asyncio`` is not installed or no credentials can be read."""
    try:
        from kubernetes_asyncio import client
        from kubernetes_asyncio import config as kube
    except ImportError:
        raise ConfigError("discovery.kubernetes: needs kubernetes_asyncio: pip install 'prefix-router[kubernetes]'") from None
    settings, namespace = client.Configuration(), None
    try:
        if config.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube.load_incluster_config(client_configuration=settings)
        else:
            loader = await kube.load_kube_config(config_file=config.kubeconfig, client_configuration=settings)
            context = getattr(loader, "current_context", None)
            with contextlib.suppress(KeyError, TypeError, AttributeError):
                namespace = context["context"].get("namespace")
    except (kube.ConfigException, OSError) as exc:
        raise ConfigError(f"discovery.kubernetes: no credentials for the Kubernetes API ({exc}); set "
                          "discovery.kubernetes.kubeconfig, $KUBECONFIG, or run in a pod") from None
    return client.ApiClient(configuration=settings), namespace
