"""``bench.meters`` reads py-spy's raw stacks (inclusive shares per part, self frames) and /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.meters import REST, active, cpu_seconds, memory_mib, parse_raw, shares, top_frames, tree_cpu_seconds

# py-spy 0.4 ``record -f raw``: one stack a line, outermost frame first, then its sample count
RAW = """\
<module> (prefix_router/cli.py:1);handle_generate (prefix_router/serve/proxy.py:55);route (prefix_router/serve/proxy.py:80);_analysis (prefix_router/serve/proxy.py:121);_analyze (prefix_router/serve/proxy.py:140);analyze (prefix_router/prompts/analysis.py:90);HFTokenizer.render_chat_tokens (prefix_router/prompts/tokenizer.py:160);HFTokenizer.tokens (prefix_router/prompts/tokenizer.py:210);HFTokenizer.encode (prefix_router/prompts/tokenizer.py:148) 6
<module> (prefix_router/cli.py:1);handle_generate (prefix_router/serve/proxy.py:55);route (prefix_router/serve/proxy.py:80);_analysis (prefix_router/serve/proxy.py:121);_analyze (prefix_router/serve/proxy.py:140);analyze (prefix_router/prompts/analysis.py:90);HFTokenizer._render (prefix_router/prompts/tokenizer.py:187) 2
<module> (prefix_router/cli.py:1);handle_generate (prefix_router/serve/proxy.py:58);forward (prefix_router/serve/forward.py:90);relay (prefix_router/serve/relay.py:200);StreamWriter._writelines (aiohttp/http_writer.py:116) 3
<module> (prefix_router/cli.py:1);handle_generate (prefix_router/serve/proxy.py:58);forward (prefix_router/serve/forward.py:90);relay (prefix_router/serve/relay.py:200);StreamWriter._writelines (aiohttp/http_writer.py:118) 1
<module> (prefix_router/cli.py:1);run_app (aiohttp/web.py:502) 8
"""


def test_each_part_counts_a_sample_once_however_many_of_its_frames_are_on_the_stack():
    got = shares(parse_raw(RAW))
    total = 6 + 2 + 3 + 1 + 8
    # analyze and _analyze are both on the first two stacks: counted once each
    assert got["chat analysis (template, tokenization, hashes, fingerprint)"] == pytest.approx(8 / total)
    assert got["  tokenization (encode)"] == pytest.approx(6 / total)
    assert got["  chat template render"] == pytest.approx(2 / total)
    assert got["forward and relay (aiohttp client and server writes)"] == pytest.approx(4 / total)
    assert got["socket writes (kernel time included)"] == pytest.approx(4 / total)
    assert got["the policy's choice"] == 0
    assert got[REST] == pytest.approx(8 / total)  # run_app's own samples, in no part


def test_self_frames_add_up_over_a_functions_lines():
    frames = dict(top_frames(parse_raw(RAW)))
    assert frames["StreamWriter._writelines (aiohttp/http_writer.py)"] == pytest.approx(4 / 20)
    assert next(iter(frames)) == "run_app (aiohttp/web.py)"  # the most samples first


def test_a_line_without_a_count_is_refused():
    with pytest.raises(ValueError, match="raw"):
        parse_raw("handle_generate (prefix_router/serve/proxy.py:55)\n")


def test_a_sample_without_python_frames_counts_in_the_total_and_no_part():
    stacks = parse_raw(RAW + " 20\n")
    assert stacks[-1] == ([], 20)
    assert shares(stacks)["  tokenization (encode)"] == pytest.approx(6 / 40)
    assert dict(top_frames(stacks))["(no Python frame)"] == pytest.approx(0.5)


def test_waiting_threads_are_dropped_and_work_in_a_system_call_is_kept():
    raw = (RAW + "<module> (prefix_router/cli.py:1);run_app (aiohttp/web.py:502);epoll_pwait (libc.so.6) 30\n"
           "_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81);"
           "pthread_cond_wait@@GLIBC_2.3.2 (libc.so.6);0x7f0aad0a3f16 (libc.so.6) 7\n"
           "<module> (prefix_router/cli.py:1);relay (prefix_router/serve/relay.py:200);write (libc.so.6) 5\n")
    kept = active(parse_raw(raw))
    assert sum(n for _, n in kept) == 20 + 5
    assert shares(kept)["forward and relay (aiohttp client and server writes)"] == pytest.approx(9 / 25)


def test_cpu_seconds_of_a_process_tree_count_its_children(tmp_path):
    # a parent that only waits on a child which burns half a second of CPU, then sleeps: the
    # tree's seconds (a --workers gateway's) hold the child's, the parent's own do not
    child = tmp_path / "burn.py"
    child.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"
                     "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, {str(child)!r}])"])
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(parent.pid) - cpu_seconds(parent.pid) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds(parent.pid) - cpu_seconds(parent.pid) >= 0.45
        assert cpu_seconds(parent.pid) < 0.45
    finally:
        for pid in Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split():
            os.kill(int(pid), 9)
        parent.kill()
        parent.wait()


def test_memory_is_read_in_mib_from_proc():
    mine = memory_mib(os.getpid())
    assert 1 < mine["VmRSS"] <= mine["VmHWM"] < 1e6
