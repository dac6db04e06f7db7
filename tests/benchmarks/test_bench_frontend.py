"""`tessera bench frontend`: real `tessera serve`s (subprocesses on loopback, the engine in a
process of its own; on a thread for the run against a baseline tree) on a tiny dummy-weight
model against the bench-serve client, then the same requests offline; every request streams
exactly its tokens (in chunks of the stream interval), and each share is the ratio of its two
figures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.cli.main import BENCHMARKS
from benchmarks import bench_frontend
from benchmarks.gpu.serving import split_cpus, tree_cpu_seconds


def test_registered_as_a_bench():
    assert "frontend" in BENCHMARKS


def test_bad_arguments_are_rejected(capsys):
    for argv in (["--concurrency", "0"], ["--rounds", "0"], ["--output-len", "0"]):
        with pytest.raises(SystemExit):
            bench_frontend.main(argv)
    capsys.readouterr()


def test_a_run_on_a_tiny_model(capsys):
    cpus = os.sched_getaffinity(0)
    result = bench_frontend.main(
        ["--concurrency", "2", "4", "--rounds", "2", "--input-words", "8", "--output-len", "9",
         "--stream-interval", "4", "--time-limit", "200", "--modes", "process"]
    )  # fmt: skip
    served = [r for r in result["results"] if "concurrency" in r]
    assert [(r["server"], r["concurrency"]) for r in served] == [
        ("engine process", 2),
        ("engine process", 4),
    ]
    for r in served:
        assert r["completed"] == 2 * r["concurrency"] and r["failed"] == 0
        assert r["total_output_tokens"] == 9 * r["completed"]
        assert r["server_cpu_us_per_token"] > 0  # the engine process's CPU counted too
    shares = [r for r in result["results"] if "share" in r]
    assert [r["mode"] for r in shares] == ["process"]
    for r in shares:
        assert r["share"] == pytest.approx(r["served_tok_s"] / r["offline_tok_s"])
        assert r["offline_cpu_us_per_token"] > 0
    printed = capsys.readouterr()
    assert "of offline at 4 streams" in printed.out
    if len(cpus) >= 2:  # pinned: the server and offline on one half, the client on the other
        server, client = split_cpus()
        assert f"on CPUs {sorted(server)}, the client on {sorted(client)}" in printed.err
    assert os.sched_getaffinity(0) == cpus  # given back after each pinned part


def test_the_cpus_split_in_two_halves():
    halves = split_cpus()
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        assert halves is None
        return
    server, client = halves
    assert server and client and not server & client and server | client == cpus
    assert len(server) == len(cpus) // 2


def test_the_servers_cpu_counts_its_descendants():
    """A child that starts a grandchild burning 0.5 s of CPU, then sleeps: the tree's CPU
    reaches what the grandchild burned (the child alone uses far less)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {burn!r}]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while (cpu := tree_cpu_seconds(proc.pid)) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cpu >= 0.5
        assert tree_cpu_seconds(2**22 + 7) is None  # no such process
    finally:
        for child in _children(proc.pid):
            os.kill(child, signal.SIGKILL)
        proc.kill()
        proc.wait()


def _children(pid: int) -> list[int]:
    return [
        int(c)
        for t in Path(f"/proc/{pid}/task").iterdir()
        for c in (t / "children").read_text().split()
    ]


def test_a_change_against_a_baseline_tree(tmp_path, capsys):
    """--baseline-tree: both servers up at once, the bursts alternating; here the baseline is
    this checkout itself (the same code on both sides), each side every burst's figures; the
    client asks for whole answers (--no-stream)."""
    root = Path(__file__).resolve().parents[2]
    with pytest.raises(SystemExit):
        bench_frontend.main(["--baseline-tree", str(tmp_path)])  # not a checkout
    result = bench_frontend.main(
        ["--baseline-tree", str(root), "--bursts", "2", "--concurrency", "2",
         "--output-len", "5", "--input-words", "6", "--modes", "thread", "--no-stream",
         "--time-limit", "200"]
    )  # fmt: skip
    (r,) = result["results"]
    for side in ("baseline", "this"):
        assert len(r[side]["tok_s"]) == 2 and min(r[side]["tok_s"]) > 0
        assert len(r[side]["cpu_us"]) == 2 and min(r[side]["cpu_us"]) > 0
    medians = [sorted(r[s]["tok_s"])[0] + sorted(r[s]["tok_s"])[1] for s in ("this", "baseline")]
    assert r["ratio"] == pytest.approx(medians[0] / medians[1])
    assert any(f"baseline tree {root}" in row["check"] for row in result["rows"])
    assert "this tree / the baseline tree" in capsys.readouterr().out


def test_each_mode_starts_its_server():
    from benchmarks.gpu.serving import SERVE_MODES, mode_flags

    assert {mode: mode_flags(mode) for mode in SERVE_MODES} == {
        "thread": (),
        "process": ("--engine-process",),
        "api2": ("--api-server-count", "2"),
        "api4": ("--api-server-count", "4"),
    }
    assert bench_frontend.build_parser().parse_args(["--modes", "api2"]).modes == ["api2"]
