"""``python -m bench fleetsim-speed``: a Mooncake trace played back to back, timed, twice alike."""

from __future__ import annotations

import json

from bench.commands.fleetsim_speed import back_to_back, main
from prefix_router.tools.fleetsim.jobs import load_jobs


def _trace(path, n=6):
    with open(path, "w") as f:
        for i in range(n):
            ids = [0, 1, 10 + i] if i % 2 else [0, 20 + i]
            f.write(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids) - 7, "output_length": 4,
                                "hash_ids": ids}) + "\n")
    return path


def test_copies_come_after_the_trace_with_blocks_of_their_own(tmp_path):
    requests = load_jobs(str(_trace(tmp_path / "t.jsonl")))
    played = back_to_back(requests, 14)
    assert len(played) == 14 and played[:6] == requests
    copy = played[6:12]
    assert min(r.at_s for r in copy) > max(r.at_s for r in requests)
    first_ids = {h for r in requests for h in r.meta["hash_ids"]}
    assert all(not first_ids & set(r.meta["hash_ids"]) for r in copy)
    assert [len(r.meta["hash_ids"]) for r in copy] == [len(r.meta["hash_ids"]) for r in requests]
    assert [r.meta["hash_ids"][0] for r in copy] == [copy[0].meta["hash_ids"][0]] * 6  # the shared block stays shared


def test_the_command_times_its_runs_and_finds_them_alike(tmp_path):
    out = tmp_path / "out"
    assert main(["--trace", str(_trace(tmp_path / "t.jsonl")), "--requests", "20", "--replicas", "4",
                 "--runs", "2", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert "python -m bench fleetsim-speed" in readme and "Identical figures in every run: yes" in readme
