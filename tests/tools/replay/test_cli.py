"""``prefix-router replay`` on the command line (``prefix_router/tools/replay/cli.py``)."""

from __future__ import annotations

import argparse

import pytest

from prefix_router.tools.replay.cli import add_parser as add_replay_parser
from prefix_router.tools.replay.cli import run as replay_cli_run


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.traj"])
def test_the_replay_cli_exits_2_when_the_trace_file_is_missing(tmp_path, capsys, name):
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers())
    args = parser.parse_args(["replay", "--target", "http://127.0.0.1:9", "--trace", str(tmp_path / name)])
    assert replay_cli_run(args) == 2
    assert "prefix-router replay:" in capsys.readouterr().err


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers())
    return replay_cli_run(parser.parse_args(["replay", *argv]))


@pytest.mark.parametrize("target", ["http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1/", "127.0.0.1:8080", "ftp://h/"])
def test_a_target_that_is_not_a_base_url_gets_one_line(target, capsys):
    assert _run(["--target", target, "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prefix-router replay: --target") and err.count("\n") == 1 and "Traceback" not in err


async def test_a_target_that_is_no_openai_server_gets_one_line(aiohttp_server, capsys):
    import asyncio

    from aiohttp import web

    async def not_here(request):
        return web.Response(status=404, text="<html>not here</html>")

    app = web.Application()
    app.router.add_get("/v1/models", not_here)
    server = await aiohttp_server(app)
    code = await asyncio.get_running_loop().run_in_executor(
        None, _run, ["--target", str(server.make_url("")).rstrip("/"), "--limit", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "answered HTTP 404 without a model list" in err and err.count("\n") == 1
