"""The process launcher's builds: the tiny tokenizer's folder answers for the corpus it was trained on."""

from __future__ import annotations

import json

from prefix_router.tools.launch import build_tiny_model, free_port, free_port_run


def test_a_tiny_tokenizer_folder_is_rebuilt_for_another_corpus_and_kept_for_the_same(tmp_path):
    # Benchmarks and tests share .cache/tiny-tokenizer, some with the agent traces as corpus and
    # some without: a folder built for one must not be served to the other.
    corpus = tmp_path / "traces"
    corpus.mkdir()
    words = "zebrafish quasar ombudsman " * 400
    (corpus / "a.traj").write_text(json.dumps({"history": [{"role": "user", "content": words}]}))
    out = tmp_path / "tok"
    build_tiny_model(out, tokenizer_only=True)
    generated = (out / "tokenizer.json").read_text()
    build_tiny_model(out, corpus=corpus, tokenizer_only=True)
    trained = (out / "tokenizer.json").read_text()
    assert trained != generated and "zebrafish" in trained and "zebrafish" not in generated
    stamp = (out / "prefix-router-version").stat().st_mtime_ns
    build_tiny_model(out, corpus=corpus, tokenizer_only=True)
    assert (out / "prefix-router-version").stat().st_mtime_ns == stamp  # the same corpus: no rebuild
    build_tiny_model(out, corpus=tmp_path / "absent", tokenizer_only=True)  # absent: generated text
    assert (out / "tokenizer.json").read_text() == generated


def test_free_ports_handed_out_by_one_process_are_all_different():
    # servers started together bind late: the OS alone may hand one free port out twice
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_free_port_run_is_free_throughout_and_never_handed_out_again():
    import socket

    first = free_port_run(3)
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: raises otherwise
    assert not set(range(first, first + 3)) & {free_port() for _ in range(50)}
