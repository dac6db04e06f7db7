"""`tessera bench frontend`: real `tessera serve`s (subprocesses on loopback, the engine on a
thread and in a process of its own) on a tiny dummy-weight model against the bench-serve
client, then the same requests offline; every request streams exactly its tokens (in chunks
of the stream interval), and each share is the ratio of its two figures."""

from __future__ import annotations

import pytest

from api.cli.main import BENCHMARKS
from benchmarks import bench_frontend


def test_registered_as_a_bench():
    assert "frontend" in BENCHMARKS


def test_bad_arguments_are_rejected(capsys):
    for argv in (["--concurrency", "0"], ["--rounds", "0"], ["--output-len", "0"]):
        with pytest.raises(SystemExit):
            bench_frontend.main(argv)
    capsys.readouterr()


def test_a_run_on_a_tiny_model(capsys):
    result = bench_frontend.main(
        ["--concurrency", "2", "4", "--rounds", "2", "--input-words", "8", "--output-len", "9",
         "--stream-interval", "4", "--time-limit", "200"]
    )  # fmt: skip
    served = [r for r in result["results"] if "concurrency" in r]
    assert [(r["server"], r["concurrency"]) for r in served] == [
        ("engine thread", 2),
        ("engine thread", 4),
        ("engine process", 2),
        ("engine process", 4),
    ]
    for r in served:
        assert r["completed"] == 2 * r["concurrency"] and r["failed"] == 0
        assert r["total_output_tokens"] == 9 * r["completed"]
    shares = [r for r in result["results"] if "share" in r]
    assert [r["mode"] for r in shares] == ["thread", "process"]
    for r in shares:
        assert r["share"] == pytest.approx(r["served_tok_s"] / r["offline_tok_s"])
    assert "of offline at 4 streams" in capsys.readouterr().out
