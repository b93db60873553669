"""The floor of an aiohttp hop: a reverse proxy that does nothing but forward (``systems.Floor`` starts it).

It accepts a request, sends its body unchanged to one upstream with a pooled aiohttp client
session, and copies the answer back chunk by chunk (SSE included), on uvloop, as the gateway
does. No parsing, no tokenizer, no policy, no metrics: what is left of the gateway's CPU per
request above this proxy's is the gateway's own work; this proxy's own is what aiohttp costs
on this machine, the least any gateway written on it can spend.

    python -m bench.floor_proxy --port 8080 --upstream http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def floor_app(upstream: str) -> web.Application:
    """The proxy as an aiohttp app: every path forwarded to ``upstream`` (a base URL); ``GET /health`` answers 200."""
    app = web.Application()

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with app["session"].request(request.method, upstream + request.path_qs, data=body,
                                          headers=headers) as upstream_resp:
            resp = web.StreamResponse(status=upstream_resp.status, headers={
                k: v for k, v in upstream_resp.headers.items() if k.lower() not in _HOP})
            await resp.prepare(request)
            async for chunk in upstream_resp.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL of the one replica")
    args = parser.parse_args(argv)
    import uvloop

    uvloop.install()
    web.run_app(floor_app(args.upstream.rstrip("/")), host=args.host, port=args.port, print=None,
                access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
