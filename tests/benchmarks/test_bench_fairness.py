"""`tessera bench fairness` runs end to end on the tiny model (short and bounded) and prints
its table: both policies, the light tenant alone and beside the heavy one."""

from __future__ import annotations

import pytest

from benchmarks import bench_fairness

pytestmark = pytest.mark.slow


def test_bench_fairness_smoke(tiny_llama_dir, capsys):
    argv = [
        "--model", str(tiny_llama_dir), "--max-num-seqs", "4", "--heavy-concurrency", "8",
        "--heavy-input", "16", "--heavy-output", "16", "--light-input", "4",
        "--light-output", "2", "--duration", "3", "--solo-duration", "2", "--warmup", "1",
        "--server-arg=--dtype=float32", "--server-arg=--max-model-len=256",
        "--server-arg=--num-kv-blocks=256",
    ]  # fmt: skip
    assert bench_fairness.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("fcfs  ", "fair  "))]
    assert [(r[0], r[1]) for r in rows] == [
        ("fcfs", "alone"), ("fcfs", "mixed"), ("fair", "alone"), ("fair", "mixed"),
    ]  # fmt: skip
    assert "HTTP " not in out  # no request refused (a random model's text may be empty)
    assert "fair vs fcfs: light TTFT p99" in out and "of fcfs" in out
