"""A hostile KV event publisher takes neither the gateway's memory nor its event loop.

ZMQ has no authentication: whoever reaches the publisher port the gateway connects to, or binds
it, can send anything. Each test here is that publisher: a real PUB socket and, where a replay is
asked, a fake ROUTER answering it. The gateway's side, an ``EventStream`` into an ``EngineView``
sized like a replica's (``cacheview.follow_events``), runs in a child process (this module, run as
``python -m tests.cache.test_stream_hostile``), so that its peak RSS (``VmHWM``) is the stream's
alone; a ticker in the child's event loop measures how long the loop was held between two of its
wake-ups, which is how late the gateway's ``/health`` would answer. Held is counted in the loop
thread's CPU time, not in wall time: on a loaded machine (a CI runner, the vLLM tier beside it)
the child may wait for a core, which no code of the gateway's can help; the wall-time lateness is
reported beside it.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from prefix_router.cache import stream as kvstream
from prefix_router.cache.blocks import block_hashes, seed_hash
from prefix_router.cache.engine_view import EngineView
from prefix_router.cache.events import BlockStored, decode_batch
from prefix_router.cache.stream import EventStream
from prefix_router.tools.sim import kv_events as sim_events

ROOT = Path(__file__).resolve().parents[2]
BS = 16  # tokens per block, vLLM's default
MODEL = "tiny"
CAPACITY = 28_000  # blocks: kvstream.REBUILD_BLOCKS's H100 replica; the view holds at most twice that
MAX_GROWTH_MB = 200.0  # peak RSS over the child's RSS once following the stream
MAX_LATE_MS = 200.0  # the longest the child's event loop may be held (CPU time between two ticks)
TICK_S = 0.005
NEAR_CAP = kvstream.MAX_MESSAGE_BYTES - 1024  # a message just under the gateway's per-message cap
END = (-1).to_bytes(8, "big", signed=True)


def seed(lora, salt):
    return seed_hash(lora or MODEL, salt)


def one_block(i: int) -> tuple[int, bytes]:
    """A one-block prompt of its own: its gateway hash, and a batch storing it."""
    tokens = [1000 + BS * i + k for k in range(BS)]
    event = sim_events.BlockStored(block_hashes=[5000 + i], parent_block_hash=None, token_ids=tokens, block_size=BS,
                                   lora_id=None, medium="GPU", lora_name=None)
    payload = msgspec.msgpack.encode(sim_events._EventBatch(1.0, [event], 0))
    return block_hashes(tokens, BS, seed(None, None))[0], payload


PROBE, FINAL, INTRUDER = one_block(0), one_block(1), one_block(2)


# --- the gateway's side, in a child process ---------------------------------------------------

def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


async def _follow(endpoint: str, replay: str | None, until: int) -> dict:
    """Follow ``endpoint`` until the batch numbered ``until`` is applied; report what it cost."""
    stream = EventStream("hostile", endpoint, replay, EngineView(BS, seed, max_blocks=2 * CAPACITY + 1024),
                         rebuild_blocks=lambda: CAPACITY, replay_timeout_s=3.0)
    late = [0.0, 0.0]  # the most CPU time, and the most wall time, the loop went without ticking

    async def tick():
        while True:
            start, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(TICK_S)
            late[0] = max(late[0], time.thread_time() - cpu)
            late[1] = max(late[1], time.perf_counter() - start - TICK_S)

    ticker, task = asyncio.create_task(tick()), asyncio.create_task(stream.run())
    while stream.batches == 0:  # the publisher sends the probe until it is heard
        await asyncio.sleep(0.005)
    base, late[:] = _kib("VmRSS"), [0.0, 0.0]
    print("READY", flush=True)
    deadline = time.monotonic() + 60
    while stream.last_seq != until and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    report = {"growth_mb": (_kib("VmHWM") - base) / 1024, "late_ms": late[0] * 1000, "late_wall_ms": late[1] * 1000,
              "alive": not task.done(),
              "last_seq": stream.last_seq, "undecodable": stream.undecodable, "fresh": stream.fresh,
              "gaps_lost": stream.gaps_lost, "stale_reason": stream.stale_reason,
              "held": [stream.view.match([h]) for h in (PROBE[0], FINAL[0], INTRUDER[0])]}
    task.cancel()
    ticker.cancel()
    return report


# --- the publisher, in the test --------------------------------------------------------------

class Publisher:
    """A PUB socket, and optionally a ROUTER answering every replay request with ``answer(start)``:
    ``(seq, payload)`` pairs sent as fast as ZMQ takes them, and whether to end with the end marker."""

    def __init__(self, answer=None) -> None:
        self.context = zmq.asyncio.Context.instance()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay = self.router = self._task = None
        self.requests: list[int] = []
        if answer is not None:
            self.router = self.context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.create_task(self._serve(answer))

    async def _serve(self, answer) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            pairs, end = answer(self.requests[-1])
            for i, (seq, payload) in enumerate(pairs):
                await self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload), copy=False)
                if i % 8 == 7:
                    await asyncio.sleep(0)
            if end:
                await self.router.send_multipart((client, b"", b"", END, b""))

    async def send(self, seq: int, payload: bytes) -> None:
        await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload), copy=False)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self.router.close()
        self.pub.close()


async def _until(future: asyncio.Future, resend) -> None:
    while not future.done():
        await resend()
        await asyncio.wait([future], timeout=0.05)


async def attack(hostile: list[tuple[int, bytes]], final_seq: int, answer=None) -> dict:
    """Start the gateway's side; publish the probe (seq 0) until it is heard, then ``hostile``,
    then ``FINAL`` as ``final_seq`` until the child has applied it. Returns the child's report."""
    publisher = Publisher(answer)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.cache.test_stream_hostile", publisher.endpoint, publisher.replay or "",
        str(final_seq), cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    try:
        ready = asyncio.ensure_future(child.stdout.readline())
        await asyncio.wait_for(_until(ready, lambda: publisher.send(0, PROBE[1])), 30)
        assert ready.result().strip() == b"READY"
        for seq, payload in hostile:
            await publisher.send(seq, payload)
        report = asyncio.ensure_future(child.stdout.readline())
        await asyncio.wait_for(_until(report, lambda: publisher.send(final_seq, FINAL[1])), 90)
        await child.wait()
        return json.loads(report.result())
    finally:
        if child.returncode is None:
            child.kill()
        publisher.close()


def _survived(report: dict, final_seq: int) -> None:
    print("child's report:", report)  # pytest -s shows the figures
    assert report["alive"] and report["last_seq"] == final_seq, report
    assert report["growth_mb"] < MAX_GROWTH_MB, report
    assert report["late_ms"] < MAX_LATE_MS, report


# --- what a publisher sends ----------------------------------------------------------------

def _array(item: bytes, size: int, head: bytes = b"", tail: bytes = b"") -> bytes:
    """``head``, a msgpack array of ``item`` repeated to make ``size`` bytes in all, ``tail``."""
    n = (size - len(head) - len(tail) - 5) // len(item)
    return head + b"\xdd" + n.to_bytes(4, "big") + item * n + tail


_TS = b"\xcb" + struct.pack(">d", 1.0)


def _events(item: bytes, size: int) -> bytes:
    """A batch ``[ts, [item, item, ...], 0]`` of ``size`` bytes."""
    return _array(item, size, head=b"\x93" + _TS, tail=b"\x00")


def _one_event(head: dict, key: str, item: bytes, size: int) -> bytes:
    """A batch of one map event: ``head``'s fields, then ``key`` an array of ``item`` repeated."""
    fields = msgspec.msgpack.encode(head)
    count = fields[0] & 0x0F
    prefix = b"\x93" + _TS + b"\x91" + bytes([0x80 | (count + 1)]) + fields[1:] + msgspec.msgpack.encode(key)
    return _array(item, size, head=prefix, tail=b"\x00")


_STORED = {"type": "BlockStored", "parent_block_hash": None, "block_size": BS, "medium": "GPU"}


def _stored_blocks(size: int, key: bytes = b"") -> bytes:
    """A batch of one well-shaped BlockStored of as many blocks as fit: every engine hash 7, every
    token 0 (a byte each), and with ``key``, extra keys of that entry for every block."""
    arrays = [("block_hashes", b"\x07", 1), ("token_ids", b"\x00", BS)] + ([("extra_keys", key, 1)] if key else [])
    head = b"\x93" + _TS + b"\x91" + bytes([0x80 | (len(_STORED) + len(arrays))]) + msgspec.msgpack.encode(_STORED)[1:]
    names = sum(len(msgspec.msgpack.encode(name)) + 5 for name, _, _ in arrays)  # each name, an array 32 header
    n = (size - len(head) - names - 1) // sum(len(item) * k for _, item, k in arrays)
    return head + b"".join(msgspec.msgpack.encode(name) + b"\xdd" + (n * k).to_bytes(4, "big") + item * (n * k)
                           for name, item, k in arrays) + b"\x00"


HOSTILE = {
    "an array of empty arrays": lambda n: _array(b"\x90", n),
    "a batch of empty arrays": lambda n: _events(b"\x90", n),
    "a batch of empty maps": lambda n: _events(b"\x80", n),
    "garbage": lambda n: random.Random(1).randbytes(n),
    "nesting": lambda n: b"\x91" * (n - 1) + b"\x90",
    "a batch of events of a type nobody knows": lambda n: _events(msgspec.msgpack.encode({"type": "x"}), n),
    "a batch of one-block removals, array-encoded": lambda n: _events(msgspec.msgpack.encode(["BlockRemoved", [7]]), n),
    "a removal of a million small hashes": lambda n: _one_event({"type": "BlockRemoved", "medium": "GPU"},
                                                                "block_hashes", b"\x07", n),
    "an event with a huge field nobody knows": lambda n: _one_event({"type": "BlockRemoved", "block_hashes": [7]}, "x",
                                                                    b"\x90", n),
    "a stored event's extra keys, an empty list a block": lambda n: _one_event(
        {**_STORED, "block_hashes": [1], "token_ids": list(range(BS))}, "extra_keys", b"\x91\x90", n),
    "a stored event's extra keys, a string a block": lambda n: _one_event(
        {**_STORED, "block_hashes": [1], "token_ids": list(range(BS))}, "extra_keys", b"\x91\xa2ab", n),
    "three-byte token ids": lambda n: _one_event({**_STORED, "block_hashes": [1]}, "token_ids", b"\xcd\x01\x2c", n),
    "a stored event of as many blocks as fit": _stored_blocks,
    "a stored event of as many blocks as fit, a string in each block's extra keys": lambda n: _stored_blocks(
        n, b"\x91\xa2ab"),
}


# --- the tests ------------------------------------------------------------------------------

async def test_a_16_mb_message_of_empty_arrays_takes_neither_memory_nor_the_loop():
    """Read untyped, it was 16 million lists: +1.2 GB and the loop stopped for 5-8 s. Over the cap
    now, ZMQ drops it with the connection, and the stream subscribes again."""
    report = await attack([(1, _array(b"\x90", 16 << 20))], final_seq=2)
    _survived(report, 2)
    assert report["held"][1] == 1  # what came after it is applied


@pytest.mark.parametrize("shape", list(HOSTILE))
async def test_a_message_just_under_the_cap_takes_neither_memory_nor_the_loop(shape):
    payload = HOSTILE[shape](NEAR_CAP)
    assert NEAR_CAP - 64 <= len(payload) <= NEAR_CAP
    report = await attack([(1, payload)], final_seq=2)
    _survived(report, 2)
    assert report["held"][1] == 1, report
    if report["fresh"]:  # the view survived it: nothing it held was lost
        assert report["held"][0] == 1, report
    else:  # it described more blocks than the replica holds: the view knows it cannot be trusted
        assert "more blocks than the replica holds" in report["stale_reason"], report


async def test_a_flood_of_messages_at_the_cap_waits_in_the_publisher_not_the_gateway():
    """Sixty-four messages just under the cap, each ~40 ms to read, sent at once: ZMQ queues
    LIVE_QUEUE of them on the gateway's side (its default, 1,000, took them all) and the rest
    wait in the publisher; every one is read, in order."""
    payload = HOSTILE["three-byte token ids"](NEAR_CAP)
    report = await attack([(seq, payload) for seq in range(1, 65)], final_seq=65)
    _survived(report, 65)
    assert report["fresh"] and report["held"][:2] == [1, 1], report


def test_one_engine_hash_repeated_for_distinct_blocks_cannot_grow_the_view():
    """A publisher repeating one engine hash for distinct blocks: the view keeps the block the
    hash named first and counts the rest as copies of it (vLLM caches one hash in two blocks, of
    one block's tokens), so it holds one entry and a count, however many it sends."""
    v = EngineView(BS, seed, max_blocks=3)
    for i in range(50):
        v.apply(BlockStored([7, 7], None, list(range(100 * i, 100 * i + 2 * BS)), BS))
    assert len(v) == 1 and len(v._engine_extra) == 1 and len(v._block_extra) == 1 and not v.overflowed
    v.apply(BlockStored([8, 9, 10], None, list(range(500, 500 + 3 * BS)), BS))
    assert v.overflowed  # distinct hashes past the bound still overflow it


def test_engine_hashes_longer_than_any_vllm_hash_are_refused():
    """vLLM's are 32 bytes (sha256) or 16 (xxh3_128); the view keeps one a block, so a publisher
    sending 4 KB ones would make its ~57,000 blocks 230 MB."""
    batch = [1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32, b"\x02" * 16, 2**64 - 1], "medium": "GPU"}]]
    assert decode_batch(msgspec.msgpack.encode(batch)).events[0].block_hashes[2] == 2**64 - 1
    for event in ({"type": "BlockRemoved", "block_hashes": [b"\x01" * 4096]},
                  {**_STORED, "block_hashes": [1], "parent_block_hash": b"\x01" * 65, "token_ids": list(range(BS))}):
        with pytest.raises(ValueError):
            decode_batch(msgspec.msgpack.encode([1.0, [event]]))


def test_a_stored_event_applied_in_slices_builds_the_view_it_builds_at_once():
    tokens = list(range(5000, 5000 + 10 * BS))
    whole, sliced = EngineView(BS, seed), EngineView(BS, seed)
    event = BlockStored(list(range(10)), None, tokens, BS)
    whole.apply(event)
    assert list(sliced.apply_steps(event, 3)) == [3, 3, 3, 1]
    assert sliced.blocks() == whole.blocks() and sliced._engine.items() == whole._engine.items()
    assert sliced.match(block_hashes(tokens, BS, seed(None, None))) == 10


def test_the_kv_event_ports_admit_the_gateway_pods_only():
    """deploy/kubernetes/vllm's NetworkPolicy selects the vLLM pods, admits the serve and epp
    gateway pods to both KV event ports, and opens nothing else but vLLM's HTTP port."""
    kube = ROOT / "deploy" / "kubernetes"
    docs = {(d["kind"], d["metadata"]["name"]): d for name in ("base", "epp")
            for d in _kustomized(kube / name)}
    policy = docs[("NetworkPolicy", "vllm-kv-events")]["spec"]
    vllm = docs[("StatefulSet", "vllm")]["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in vllm["spec"]["containers"][0]["ports"]}
    config = json.loads(next(a for a in vllm["spec"]["containers"][0]["args"] if a.startswith("--kv-events-config="))
                        .split("=", 1)[1])
    assert {config["endpoint"].rsplit(":", 1)[1], config["replay_endpoint"].rsplit(":", 1)[1]} == \
        {str(ports["kv-events"]), str(ports["kv-replay"])}
    gated, opened = policy["ingress"]
    assert {p["port"] for p in gated["ports"]} == {"kv-events", "kv-replay"}
    (peer,) = gated["from"]
    (rule,) = peer["podSelector"]["matchExpressions"]
    for name in ("prefix-router", "prefix-router-epp"):
        labels = docs[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        assert rule["operator"] == "In" and labels[rule["key"]] in rule["values"]
    assert "from" not in opened and [p["port"] for p in opened["ports"]] == ["http"]


def _kustomized(folder: Path) -> list[dict]:
    import yaml

    out = []
    for name in yaml.safe_load((folder / "kustomization.yaml").read_text())["resources"]:
        path = (folder / name).resolve()
        out += _kustomized(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


async def test_sequence_numbers_out_of_vllms_range_are_ignored():
    """vLLM counts from 0 (``itertools.count``) and sends 8 unsigned bytes; 2**64 - 1 is the
    replay's end marker read unsigned. Before, it was applied, and catch_up then raised."""
    publisher = Publisher(answer=lambda start: ([], True))
    stream = EventStream("hostile", publisher.endpoint, publisher.replay, EngineView(BS, seed), replay_timeout_s=1.0)
    task = asyncio.create_task(stream.run())
    try:
        for _ in range(200):
            await publisher.send(0, PROBE[1])
            await asyncio.sleep(0.02)
            if stream.batches:
                break
        for seq in (2**64 - 1, 2**63):
            await publisher.send(seq, INTRUDER[1])
            for _ in range(100):
                await asyncio.sleep(0.02)
                if stream.undecodable + stream.batches + stream.restarts >= 2 + (seq == 2**63):
                    break
            assert await stream.catch_up() == 0  # raised OverflowError after 2**64 - 1
        await publisher.send(1, FINAL[1])
        for _ in range(100):
            await asyncio.sleep(0.02)
            if stream.last_seq == 1:
                break
        assert stream.undecodable == 2 and stream.restarts == 0 and stream.gaps_lost == 0
        assert stream.fresh and not task.done()
        assert [stream.view.match([h]) for h in (PROBE[0], FINAL[0], INTRUDER[0])] == [1, 1, 0]
    finally:
        task.cancel()
        publisher.close()


async def test_a_replay_keeps_only_increasing_sequence_numbers_in_its_range():
    """The replay socket answers the gap 1-2 with duplicates, a batch before it and one after it:
    the gap is repaired with the first of each, in order."""
    first, second = one_block(10), one_block(11)
    answer = [(1, first[1]), (1, INTRUDER[1]), (0, INTRUDER[1]), (2, second[1]), (1, INTRUDER[1]),
              (2, INTRUDER[1]), (9, INTRUDER[1])]
    publisher = Publisher(answer=lambda start: (answer, True))
    stream = EventStream("hostile", publisher.endpoint, publisher.replay, EngineView(BS, seed))
    try:
        await stream.receive(0, PROBE[1])
        await stream.receive(3, FINAL[1])
        assert publisher.requests == [1]
        assert stream.gaps_repaired == 1 and stream.gaps_lost == 0 and stream.fresh
        held = [stream.view.match([h]) for h in (PROBE[0], first[0], second[0], FINAL[0], INTRUDER[0])]
        assert held == [1, 1, 1, 1, 0]
    finally:
        publisher.close()


async def test_a_replay_past_its_byte_budget_is_a_lost_gap_not_the_gateways_memory():
    """The replay socket answers a gap with a hundred messages just under the cap (400 MB with a
    4 MB cap, sent as fast as ZMQ takes them) and no end: the stream stops reading past its
    budget, loses the gap, and goes on."""
    garbage = random.Random(2).randbytes(NEAR_CAP)
    report = await attack([(1000, FINAL[1])], final_seq=1000,  # the first replay (start 0) is an empty buffer
                          answer=lambda start: ([(start + i, garbage) for i in range(100 if start else 0)], not start))
    _survived(report, 1000)
    assert report["gaps_lost"] == 1 and "bytes" in report["stale_reason"], report


if __name__ == "__main__":
    endpoint, replay, until = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
    print(json.dumps(asyncio.run(_follow(endpoint, replay, until))), flush=True)
