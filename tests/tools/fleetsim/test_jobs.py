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
    blocks = new_blocks()
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


def _block_log(path, conversations: int = 12, turns: int = 4):
    """A request log written with ``request_log_blocks``: conversations whose turns grow their
    prompt by a few blocks, keyed chains (``keyed_blocks``) of made-up block hashes."""
    import random

    from prefix_router.misses.request_log import keyed_blocks

    rng, lines, t = random.Random(3), [], 1000.0
    for c in range(conversations):
        chain = [rng.getrandbits(64) for _ in range(20)]  # its own history from the first turn
        for turn in range(turns):
            chain += [rng.getrandbits(64) for _ in range(rng.randrange(2, 6))]
            t += rng.random()
            lines.append({"t": t + 0.5, "elapsed_s": 0.5, "status": 200, "conversation": f"{c:016x}",
                          "blocks": keyed_blocks(chain, b"a key of sixteen+"), "block_size": 16, "units": 16 * len(chain) + 5,
                          "completion_tokens": 12})
    rng.shuffle(lines)  # written as they ended
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_request_log_with_blocks_is_replayed_in_order_with_its_conversations_reuse(tmp_path):
    from prefix_router.tools.fleetsim.run import FleetConfig, simulate

    path = tmp_path / "requests.jsonl"
    _block_log(path)
    jobs = load_jobs(str(path))
    assert [j.at_s for j in jobs] == sorted(j.at_s for j in jobs) and len({j.session for j in jobs}) == 12
    tok = load_tokenizer(None)
    _, first = prompt_of(jobs[0], tok, block_size=16, char_block_size=64)
    later = next(j for j in jobs[1:] if j.session == jobs[0].session)
    _, second = prompt_of(later, tok, block_size=16, char_block_size=64)
    assert second[:len(first) - 5] == first[:-5]  # a turn's prompt starts with its previous turn's blocks
    fleet = FleetConfig(replicas=4)
    ours, spread = (simulate(jobs, p, fleet, tok) for p in ("prefix-router", "round-robin"))
    assert ours["token_hit_rate"] > spread["token_hit_rate"] + 0.2
