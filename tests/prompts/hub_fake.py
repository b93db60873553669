"""A fake Hugging Face Hub for the tokenizer download (``tokenizer.fetch_tokenizer``): the four
requests huggingface_hub's ``snapshot_download`` makes of a model repository, as
``huggingface_hub/hf_api.py`` (``model_info``, ``list_repo_tree``) and ``file_download.py``
(``get_hf_file_metadata``, ``http_get``) make them, answered from a local folder with the
fields and headers those read. No real Hub is reachable from CI; this speaks its protocol."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a commit hash as the Hub gives one: 40 hex digits


def hub_app(repos: dict[str, Path], requests: list[str]) -> web.Application:
    """``repos``: repository id ("org/name") -> the folder whose files it holds. ``requests``
    collects each request's method and path, for tests to read what was fetched."""

    def files(repo: str) -> dict[str, bytes]:
        if repo not in repos:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"}, text='{"error": "Repository not found"}')
        return {f.name: f.read_bytes() for f in sorted(repos[repo].iterdir()) if f.is_file()}

    def oid(data: bytes) -> str:  # git's blob id
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    @web.middleware
    async def log(request: web.Request, handler):
        requests.append(f"{request.method} {request.path}")
        return await handler(request)

    async def info(request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "siblings": [{"rfilename": f} for f in files(repo)]})

    async def tree(request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response([{"type": "file", "path": f, "size": len(d), "oid": oid(d)}
                                  for f, d in files(repo).items()])

    async def resolve(request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        data = files(repo).get(request.match_info["file"])
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"}, text='{"error": "Entry not found"}')
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{oid(data)}"', "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return web.Response(headers=headers)
        return web.Response(body=data, headers=headers)

    app = web.Application(middlewares=[log])
    app.router.add_get("/api/models/{org}/{name}/revision/{rev}", info)
    app.router.add_get("/api/models/{org}/{name}/tree/{rev}", tree)
    app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file}", resolve)
    return app


def stalled_app(release: asyncio.Event) -> web.Application:
    """A Hub that accepts every request and answers none until ``release`` is set (a proxy or
    endpoint that hangs): huggingface_hub sends its API calls without a timeout."""

    async def stall(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(status=503)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", stall)
    return app
