"""What an operator meets on the command line: start-up errors in one line that name the fix,
log options before or after the command, JSON log lines, a request log with bodies from a flag,
and tools that stop quietly when their reader leaves."""

from __future__ import annotations

import json
import signal
import socket
import os
import subprocess
import sys
import urllib.request

import pytest

from prefix_router.config import ConfigError, config_from_dict
from prefix_router.prompts.tokenizer import HFTokenizer
from prefix_router.tools.launch import free_port, gateway_server, running, sim_server

CLI = [sys.executable, "-m", "prefix_router.cli"]


def test_a_replica_url_ending_in_v1_is_refused_with_the_base_url_to_give():
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.url: expected the replica's base URL, http://a:8000, "):
        config_from_dict({"replicas": ["http://a:8000/v1/"]})
    assert config_from_dict({"replicas": ["http://a:8000/"]}).replicas[0].url == "http://a:8000"


def test_a_key_read_from_an_unset_environment_variable_names_the_variable_and_the_item(monkeypatch):
    monkeypatch.delenv("PR_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ConfigError) as info:
        config_from_dict({"auth": {"tenants": [{"name": "a", "keys": ["a-good-key-1", "env:PR_TEST_UNSET_KEY"]}]}})
    assert str(info.value) == ("auth.tenants[0].keys[1]: environment variable PR_TEST_UNSET_KEY is not set "
                               "(the key is read from it)")


@pytest.mark.parametrize("folder", [False, True], ids=["no-such-folder", "folder-without-a-tokenizer"])
def test_a_tokenizer_that_cannot_load_is_one_line_naming_the_path(tmp_path, folder):
    path = tmp_path / "tok"
    if folder:
        path.mkdir()
    with pytest.raises(OSError) as info:
        HFTokenizer(str(path))
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert ("holds no tokenizer" if folder else "no folder") in message
    out = subprocess.run(CLI + ["serve", "--replica", "http://127.0.0.1:9", "--tokenizer", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"prefix-router serve: {message}"]


@pytest.mark.parametrize("command", ["serve", "epp", "epp --grpc-port"])
def test_a_taken_port_is_the_one_line_printed(command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        name, *grpc = command.split()
        ports = ["--port", str(free_port()), "--grpc-port", str(port)] if grpc else ["--port", str(port)]
        if name == "epp" and not grpc:
            ports += ["--grpc-port", str(free_port())]
        out = subprocess.run(CLI + [name, "--replica", "http://127.0.0.1:9", "--host", "127.0.0.1", *ports],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"prefix-router {name}: cannot listen on 127.0.0.1:{port}: "), lines
    if not grpc:  # what to do about it: who holds it, or another port
        assert f"sport = :{port}" in lines[0] and "--port" in lines[0], lines


def test_log_options_work_after_the_command_and_json_lines_name_level_logger_and_message():
    port = free_port()
    proc = subprocess.Popen(CLI + ["serve", "--replica", "http://127.0.0.1:9", "--host", "127.0.0.1", "--port",
                                   str(port), "--log-format", "json", "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stderr.readline())  # the replica down: a warning, before serving
        _wait_ready_status(port, 503)  # serving, and not ready: nothing is on the ring
        proc.send_signal(signal.SIGTERM)
        rest = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    records = [first, *rest]
    assert all(set(r) == {"time", "level", "logger", "message"} for r in records)
    assert first["logger"] == "prefix_router.fleet.replicas" and first["level"] == "WARNING"
    assert "http://127.0.0.1:9/health" in first["message"]
    assert any(r["level"] == "INFO" and r["message"].startswith("shutting down") for r in rest), rest


def _wait_ready_status(port: int, status: int) -> None:
    import time
    import urllib.error

    for _ in range(100):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                got = resp.status
        except urllib.error.HTTPError as exc:
            got = exc.code
        except OSError:
            got = None
        if got == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"/ready never answered {status}")


def test_a_tool_whose_reader_leaves_stops_without_a_traceback(tmp_path):
    log = tmp_path / "bodies.jsonl"
    body = {"messages": [{"role": "user", "content": "hello " * 50}]}
    log.write_text("".join(json.dumps({**body, "session": f"s{i}"}) + "\n" for i in range(50)))
    proc = subprocess.Popen(CLI + ["audit", "--json", str(log)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does once it has what it wants
    _, err = proc.communicate(timeout=60)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_the_request_log_bodies_flag_writes_what_audit_reads(tmp_path):
    log = tmp_path / "requests.jsonl"
    with running([sim_server(tmp_path, ["--model", "sim"])]) as (replica,):
        with running([gateway_server(tmp_path, [replica], ["--request-log", str(log), "--request-log-bodies"])]) \
                as (gateway,):
            body = {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi there"}]}
            request = urllib.request.Request(gateway + "/v1/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as resp:
                assert resp.status == 200
    line = json.loads(log.read_text().splitlines()[0])
    assert line["path"] == "/v1/chat/completions" and line["body"]["messages"] == body["messages"]
    out = subprocess.run(CLI + ["audit", "--json", str(log)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["totals"]["requests"] == 1, out.stderr


def test_a_request_log_key_too_short_to_be_secret_is_one_line_and_status_2(tmp_path):
    out = subprocess.run(CLI + ["serve", "--replica", "http://127.0.0.1:9", "--port", "0", "--request-log",
                                str(tmp_path / "r.jsonl"), "--request-log-blocks"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PREFIX_ROUTER_REQUEST_LOG_KEY": "word"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "prefix-router serve: PREFIX_ROUTER_REQUEST_LOG_KEY must be a secret of at least 16 characters"]


def test_the_endpoint_picker_refuses_data_parallel_ranks_in_one_line(tmp_path):
    (tmp_path / "gateway.yaml").write_text("replicas: [{url: 'http://127.0.0.1:9', data_parallel_size: 4}]\n")
    out = subprocess.run([*CLI, "epp", "--config", str(tmp_path / "gateway.yaml"), "--port", str(free_port()),
                          "--grpc-port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("prefix-router epp: replicas[0].data_parallel_size: the endpoint picker")
