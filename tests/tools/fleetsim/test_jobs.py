"""The fleet simulator's requests (``tools/fleetsim/jobs.py``): a Mooncake trace read lazily gives
the prompts the replayer sends, and the gateway's analysis of them."""

from __future__ import annotations

import json

import pytest

from prefix_router.prompts.analysis import analyze
from prefix_router.prompts.tokenizer import load_tokenizer
from prefix_router.tools.fleetsim.jobs import load_jobs, new_blocks, prompt_of
from prefix_router.tools.replay.workloads import load_mooncake

RECORDS = [{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]},
           {"timestamp": 250, "input_length": 1024, "output_length": 9, "hash_ids": [1, 3]},
           {"timestamp": 900, "input_length": 300, "output_length": 1, "hash_ids": [4]}]


@pytest.fixture()
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def test_a_mooncake_record_is_sent_with_the_prompt_the_replayer_sends(trace):
    tok = load_tokenizer(None)
    lazy = load_jobs(str(trace))
    eager = load_mooncake(trace)
    blocks = new_blocks(512)
    assert [r.at_s for r in lazy] == [r.at_s for r in eager] == [0.0, 0.25, 0.9]
    for job, sent in zip(lazy, eager):
        assert "prompt" not in job.body  # made only when sent
        info, ids = prompt_of(job, tok, block_size=16, char_block_size=64, blocks=blocks)
        assert ids == sent.body["prompt"] and job.body["max_tokens"] == sent.body["max_tokens"]
        assert info.hashes == analyze(sent.body, False, tok, 16, 64, None).hashes


def test_a_limit_reads_only_the_first_records_and_a_bad_record_names_its_line(trace, tmp_path):
    assert len(load_jobs(str(trace), limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({**RECORDS[1], "input_length": 5000}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_jobs(str(bad))


def test_without_a_trace_the_built_in_workload_is_sent_as_the_replayer_would():
    jobs = load_jobs(None, workload="chat", limit=5)
    info, ids = prompt_of(jobs[0], load_tokenizer(None), block_size=16, char_block_size=64)
    assert len(jobs) == 5 and info.exact and len(info.hashes) == len(ids) // 16
