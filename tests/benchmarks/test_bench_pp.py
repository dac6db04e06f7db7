"""`tessera bench pp`: a run on a tiny model times PP = 1 and PP = 2 on the same two CPUs,
reports each stage's idle share from the ranks' step timers, and greedy PP = 2 produces PP =
1's tokens."""

from __future__ import annotations

import json
import os

import pytest

from api.cli.main import BENCHMARKS
from benchmarks import bench_pp


def test_registered_as_a_bench():
    assert "pp" in BENCHMARKS


def test_bad_arguments_are_rejected(capsys):
    for argv in (
        ["--streams", "0"],
        ["--streams", "a,b"],
        ["--rounds", "0"],
        ["--output-len", "0"],
        ["--pp-batch-tokens", "8"],
    ):
        with pytest.raises(SystemExit) as e:
            bench_pp.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two usable CPUs",
)
def test_a_run_on_a_tiny_model(tiny_llama_dir, tmp_path):
    affinity = os.sched_getaffinity(0)
    out = tmp_path / "pp.json"
    # 32 streams: a PP = 2 step's budget of 16 tokens leaves two batches of decodes in flight
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--streams", "32"]
    argv += ["--prompt-len", "8", "--output-len", "6", "--rounds", "2", "--json", str(out)]
    try:
        result = bench_pp.main(argv)
    finally:
        os.sched_setaffinity(0, affinity)  # the benchmark pins this process
    assert json.loads(out.read_text()) == result
    assert len(result["machine"]["cpus"]) == 2
    (row,) = result["rows"]
    assert row["streams"] == 32 and row["pp2_batch_tokens"] == 16
    assert row["same_tokens"]  # greedy PP = 2 equals PP = 1
    assert row["pp1"]["threads"] == 2 and row["pp2"]["threads_per_stage"] == 1
    for side, stages in (("pp1", [0]), ("pp2", [0, 1])):
        run = row[side]
        assert run["output_tokens"] == 32 * 6 and run["tok_s"] > 0 and run["decode_tok_s"] > 0
        assert [s["stage"] for s in run["stages"]] == stages
        for s in run["stages"]:
            assert s["steps"] > 0 and s["busy_s"] > 0
            assert 0.0 <= s["idle_share"] <= 1.0
            assert s["idle_share"] >= s["outside_step_share"]
    first, last = row["pp2"]["stages"]
    # only the later stage waits for activations, and only the earlier one sends them
    assert first["input_wait_share"] == 0.0 and last["input_wait_share"] > 0.0
    assert first["send_share"] > 0.0 and last["send_share"] == 0.0
    # PP = 1 takes a decode step for all 32 rows, PP = 2 two steps of 16: twice the steps
    assert row["pp2"]["stages"][0]["steps"] > row["pp1"]["stages"][0]["steps"]
    assert row["decode_ratio"] > 0
    assert row["ratio"] == pytest.approx(row["pp2"]["tok_s"] / row["pp1"]["tok_s"], rel=1e-2)
