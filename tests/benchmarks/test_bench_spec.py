"""`tessera bench spec`: a run on a tiny model reports a row per workload and stream count,
with both engines producing the same greedy tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_spec


def test_bad_arguments_are_rejected(capsys):
    for argv in (
        ["--streams", "0"],
        ["--output-len", "1"],
        ["--workloads", "poems"],
        ["--rounds", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            bench_spec.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_copy_prompt_repeats_the_passage():
    p = bench_spec.copy_prompt(bench_spec.PASSAGES[0])
    assert p.count(bench_spec.PASSAGES[0]) == 2 and p.endswith(
        bench_spec.PASSAGES[0][: len(bench_spec.PASSAGES[0]) // 4]
    )


@pytest.mark.slow
def test_a_run_on_a_tiny_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "spec.json"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--streams", "1,2"]
    argv += ["--output-len", "12", "--json", str(out)]
    result = bench_spec.main(argv)
    assert json.loads(out.read_text()) == result
    assert [(r["workload"], r["streams"]) for r in result["rows"]] == [
        ("copy", 1),
        ("copy", 2),
        ("open", 1),
        ("open", 2),
    ]
    for r in result["rows"]:
        assert r["same_tokens"] and r["tpot_ratio"] > 0
        assert 0.0 <= r["acceptance_rate"] <= 1.0
