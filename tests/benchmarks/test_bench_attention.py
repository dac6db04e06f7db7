"""`tessera bench attention`: the workload, argument checks, and a small run in which the
kernel's output must match the torch path's on the same caches."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_attention
from engine.attention import cpu_kernel


def test_workload_is_reproducible_and_in_range():
    args = bench_attention.parse_args(["--rows", "40", "--context", "5", "70"])
    seqs, blocks = bench_attention.workload(args)
    assert (seqs, blocks) == bench_attention.workload(args)
    lengths = [start + 1 for start, n, _ in seqs]
    assert all(n == 1 for _, n, _ in seqs) and all(5 <= c <= 70 for c in lengths)
    assert lengths == sorted(lengths)
    used = [b for _, _, table in seqs for b in table]
    assert sorted(used) == list(range(blocks))  # every block once, none shared
    assert all(len(table) == -(-c // 16) for c, (_, _, table) in zip(lengths, seqs, strict=True))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--context", "40", "8"], "--context"),
        (["--rows", "0"], "--rows"),
        (["--heads", "9", "--kv-heads", "2"], "--kv-heads"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_attention.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_small_run_kernel_matches_torch(kv, tmp_path, capsys):
    if not cpu_kernel.kernel_supports(torch.bfloat16, torch.device("cpu"), 3, 64):
        pytest.skip("no C compiler for the CPU kernel")
    out = tmp_path / "r.json"
    argv = ["--rows", "6", "--layers", "2", "--steps", "1", "--context", "1", "50"]
    assert bench_attention.main([*argv, "--kv-cache-dtype", kv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["path"] for r in report["results"]] == ["kernel", "torch"]
    assert all(r["median_ms"] > 0 and r["kv_gb_s"] > 0 for r in report["results"])
    assert report["max_abs_diff"] < 2e-2
    assert "| kernel |" in capsys.readouterr().out
