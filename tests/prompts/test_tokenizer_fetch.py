"""``--tokenizer MODEL_ID --tokenizer-download``: the gateway fetches a model's tokenizer files
(and no weights) from a Hugging Face Hub, here a fake one speaking the Hub's protocol
(``hub_fake.py``), into the local Hugging Face cache, and then tokenizes as the folder's own
tokenizer does; with HF_HUB_OFFLINE=1 or without the flag it downloads nothing and says so in
one line. Each run is a subprocess: huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE at import."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from prefix_router.prompts.tokenizer import TOKENIZER_FILES, HFTokenizer
from prefix_router.tools.tiny_model import build_tokenizer
from tests.prompts.hub_fake import hub_app, stalled_app

REPO = "tiny-org/tiny-chat"
TEXT = "The gateway hashes each prompt's leading token blocks."

SCRIPT = """
import sys
from prefix_router.prompts.tokenizer import HFTokenizer, fetch_tokenizer
fetch_tokenizer(sys.argv[1])
print(HFTokenizer(sys.argv[1]).encode(sys.argv[2]))
"""


@pytest.fixture
def repo(tmp_path) -> Path:
    folder = tmp_path / "repo"
    folder.mkdir()
    build_tokenizer(folder, None)
    from transformers import LlamaConfig

    # a model repository as the Hub holds one: config.json (transformers reads it before the
    # tokenizer of a cached model id), and weights, never fetched for a tokenizer
    LlamaConfig(vocab_size=len(HFTokenizer(str(folder))._tok), hidden_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    return folder


def _env(tmp_path: Path, endpoint: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1",
            **extra}


async def _run(*args: str, env: dict) -> subprocess.CompletedProcess:
    proc = await asyncio.create_subprocess_exec(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def test_a_model_id_is_fetched_tokenizer_files_alone_and_tokenizes_as_its_folder(aiohttp_server, repo, tmp_path):
    requests: list[str] = []
    hub = await aiohttp_server(hub_app({REPO: repo}, requests))
    env = _env(tmp_path, str(hub.make_url("")).rstrip("/"))
    run = await _run(sys.executable, "-c", SCRIPT, REPO, TEXT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(HFTokenizer(str(repo)).encode(TEXT))
    fetched = {r.rsplit("/", 1)[1] for r in requests if r.startswith("GET") and "/resolve/" in r}
    assert "tokenizer.json" in fetched and "model.safetensors" not in fetched
    import fnmatch

    assert all(any(fnmatch.fnmatch(f, p) for p in TOKENIZER_FILES) for f in fetched)
    # cached now: a second run asks the Hub for nothing, even offline
    before = len(requests)
    again = await _run(sys.executable, "-c", SCRIPT, REPO, TEXT, env={**env, "HF_HUB_OFFLINE": "1"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout == run.stdout and len(requests) == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_offline_mode_and_an_unknown_repository_are_one_line_each(aiohttp_server, repo, tmp_path):
    requests: list[str] = []
    hub = await aiohttp_server(hub_app({REPO: repo}, requests))
    env = _env(tmp_path, str(hub.make_url("")).rstrip("/"))
    serve = [sys.executable, "-m", "prefix_router.cli", "serve", "--replica", "http://127.0.0.1:9",
             "--port", str(_free_port())]
    offline = await _run(*serve, "--tokenizer", REPO, "--tokenizer-download", env={**env, "HF_HUB_OFFLINE": "1"})
    unknown = await _run(*serve, "--tokenizer", "tiny-org/no-such-model", "--tokenizer-download", env=env)
    not_asked = await _run(*serve, "--tokenizer", REPO, env=env)
    path = await _run(*serve, "--tokenizer", str(tmp_path / "no-such-folder"), "--tokenizer-download", env=env)
    for run, words in ((offline, "HF_HUB_OFFLINE=1"), (unknown, "could not download tiny-org/no-such-model"),
                       (not_asked, "--tokenizer-download"), (path, f"no folder {tmp_path / 'no-such-folder'}")):
        assert run.returncode == 2, run.stderr[-2000:]
        assert "Traceback" not in run.stderr and words in run.stderr, run.stderr[-2000:]
        assert "HTTP Request" not in run.stderr  # the Hub client's own request lines stay out
    assert not any("/resolve/" in r for r in requests)  # nothing fetched by any of them


async def test_a_hub_that_never_answers_is_one_line_within_the_deadline(aiohttp_server, tmp_path):
    release = asyncio.Event()
    hub = await aiohttp_server(stalled_app(release))
    script = ("import sys\nfrom prefix_router.prompts.tokenizer import fetch_tokenizer\n"
              "try:\n    fetch_tokenizer(sys.argv[1], timeout_s=2)\n"
              "except OSError as exc:\n    sys.exit(f'error: {exc}')\n")
    started = asyncio.get_running_loop().time()
    try:
        run = await _run(sys.executable, "-c", script, REPO, env=_env(tmp_path, str(hub.make_url("")).rstrip("/")))
    finally:
        release.set()
    assert asyncio.get_running_loop().time() - started < 60  # not the minutes huggingface_hub would wait
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [f"error: tokenizer: could not download {REPO} from "
                                               f"{str(hub.make_url('')).rstrip('/')}: no complete answer within 2 s"]
