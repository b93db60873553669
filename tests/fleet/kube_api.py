"""A fake Kubernetes API server for pod discovery tests: ``GET /api/v1/namespaces/{ns}/pods`` as
kube-apiserver answers it, LIST and WATCH, written from the API's documentation
(https://kubernetes.io/docs/reference/using-api/api-concepts/) and its sources.

- Every change takes the next resourceVersion; a pod's ``metadata.resourceVersion`` is its last.
- LIST: ``{"kind": "PodList", "metadata": {"resourceVersion"}, "items"}``, the label selector
  applied (``k=v``, ``k!=v``, ``k``, ``!k``, comma for "and").
- WATCH (``watch`` true as the apiserver reads booleans: anything but absent, ``false``, ``0``):
  from ``resourceVersion``, the changes after it (no synthetic ADDED), then live ones, one compact
  JSON object a line, until ``timeoutSeconds``. Through the selector, as the apiserver's cacher
  converts them: a pod that starts matching is ADDED, one that stops is DELETED (its old state).
  With ``allowWatchBookmarks``, a BOOKMARK now and then carrying only the resourceVersion.
- History older than ``expire()`` left: a watch from before it gets HTTP 200 and one ERROR event
  with a Status of code 410, reason Expired (``cacher.go``'s ``newErrWatcher``,
  ``watch_cache.go``), or, with ``gone_as_http``, an HTTP 410 with that Status.
- ``drop_watches()`` cuts every open watch mid-stream, as a connection reset would.
"""

from __future__ import annotations

import asyncio
import copy
import json

from aiohttp import web

__all__ = ["FakeKubeApi", "kubeconfig"]


def _truthy(value: str | None) -> bool:
    return value is not None and value not in ("false", "0")


def _matches(labels: dict, selector: str | None) -> bool:
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key.rstrip("=")) != value.lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


class FakeKubeApi:
    """The pods of one namespace behind a fake API server (module docstring). ``requests``: the
    query of every call, for tests to read."""

    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.version = 100
        self.oldest = 0  # a watch from before this resourceVersion is told 410
        self.pods: dict[str, dict] = {}
        self.history: list[tuple[int, dict | None, dict | None]] = []  # (version, old pod, new pod)
        self.watchers: list[asyncio.Queue] = []
        self.requests: list[dict] = []
        self.gone_as_http = False
        self.app = web.Application()
        self.app.router.add_get("/api/v1/namespaces/{namespace}/pods", self.handle)

    # -- changes -------------------------------------------------------------------------------
    def put(self, name: str, ip: str, *, ready: bool = True, labels: dict | None = None,
            deleting: bool = False, annotations: dict | None = None) -> None:
        """Create or change a pod: its IP, Ready condition, labels, annotations, and whether it is
        terminating."""
        old = self.pods.get(name)
        self.version += 1
        pod = {"kind": "Pod", "apiVersion": "v1",
               "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": str(self.version),
                            "labels": dict(labels if labels is not None else {"app": "vllm"}),
                            **({"annotations": dict(annotations)} if annotations else {})},
               "status": {"phase": "Running", "podIP": ip,
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        if deleting:
            pod["metadata"]["deletionTimestamp"] = "2026-12-07T10:00:00Z"
            pod["metadata"]["deletionGracePeriodSeconds"] = 30
        self.pods[name] = pod
        self._emit(old, pod)

    def delete(self, name: str) -> None:
        old = self.pods.pop(name)
        self.version += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._emit(gone, None)

    def expire(self) -> None:
        """Forget the history (etcd's compaction): a watch from an older version gets 410."""
        self.oldest = self.version
        self.history.clear()

    def drop_watches(self) -> None:
        for queue in self.watchers:
            queue.put_nowait("drop")

    def _emit(self, old: dict | None, new: dict | None) -> None:
        self.history.append((self.version, old, new))
        for queue in self.watchers:
            queue.put_nowait((self.version, old, new))

    # -- the API -------------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": []})
        selector = query.get("labelSelector")
        if not _truthy(query.get("watch")):
            items = [p for p in self.pods.values() if _matches(p["metadata"].get("labels") or {}, selector)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": items})
        return await self._watch(request, query, selector)

    async def _watch(self, request: web.Request, query: dict, selector: str | None) -> web.StreamResponse:
        since = int(query.get("resourceVersion") or 0)
        expired = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                   "message": f"too old resource version: {since} ({self.oldest})", "reason": "Expired", "code": 410}
        if since < self.oldest and self.gone_as_http:
            return web.json_response(expired, status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if since < self.oldest:
            await response.write(json.dumps({"type": "ERROR", "object": expired}).encode() + b"\n")
            return response
        queue: asyncio.Queue = asyncio.Queue()
        for change in self.history:
            if change[0] > since:
                queue.put_nowait(change)
        self.watchers.append(queue)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        try:
            while (left := deadline - loop.time()) > 0:
                try:
                    change = await asyncio.wait_for(queue.get(), timeout=min(left, 0.3))
                except asyncio.TimeoutError:
                    if bookmarks:
                        bookmark = {"kind": "Pod", "apiVersion": "v1",
                                    "metadata": {"resourceVersion": str(self.version)}}
                        await response.write(json.dumps({"type": "BOOKMARK", "object": bookmark}).encode() + b"\n")
                    continue
                if change == "drop":
                    request.transport.close()  # a reset, mid-stream: no clean end
                    return response
                event = self._through(selector, *change)
                if event is not None:
                    await response.write(json.dumps(event).encode() + b"\n")
        finally:
            self.watchers.remove(queue)
        await response.write_eof()
        return response

    @staticmethod
    def _through(selector: str | None, version: int, old: dict | None, new: dict | None) -> dict | None:
        """A change as a watch with ``selector`` sees it (the apiserver's ``convertToWatchEvent``)."""
        was = old is not None and _matches(old["metadata"].get("labels") or {}, selector)
        now = new is not None and _matches(new["metadata"].get("labels") or {}, selector)
        if now:
            return {"type": "MODIFIED" if was else "ADDED", "object": new}
        if was:
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(version)
            return {"type": "DELETED", "object": gone}
        return None


def kubeconfig(path, server: str, namespace: str = "llm") -> str:
    """A kubeconfig file for ``server`` with a bearer token, as ``kubectl config`` writes one."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "gateway", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "gateway", "namespace": namespace}}]}))
    return str(path)
