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
        ["--draft", "a", "--eagle", "b"],
        ["--eagle", "a", "--eagle3", "b"],
        ["--adaptive", "maybe"],
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


@pytest.mark.slow
def test_a_draft_model_run(tiny_llama_dir, tmp_path):
    """--draft: the target as its own draft, so every draft is accepted (up to k + 1 tokens
    per verification: fewer near max_tokens) and the tokens are plain decoding's."""
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--streams", "2"]
    argv += ["--output-len", "12", "--workloads", "open", "--rounds", "1"]
    argv += ["--draft", str(tiny_llama_dir), "--num-speculative-tokens", "2"]
    argv += ["--adaptive", "off"]  # every step drafts: the tokens per verification are checked
    result = bench_spec.main(argv)
    assert result["speculative_config"]["method"] == "draft_model"
    (row,) = result["rows"]
    assert row["same_tokens"] and row["tpot_draft_ms"] > 0 and row["tpot_ratio"] > 0
    assert row["acceptance_rate"] == 1.0 and 2.0 < row["tokens_per_verification"] <= 3.0


@pytest.mark.slow
def test_the_controller_on_and_off_interleaved(tiny_llama_dir):
    """--adaptive both: a third engine with the draft controller off runs beside the plain
    one and the controlled one; every row reports both, all three produce the same tokens."""
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--streams", "2"]
    argv += ["--output-len", "12", "--workloads", "copy", "--rounds", "3", "--adaptive", "both"]
    result = bench_spec.main(argv)
    assert result["speculative_config"]["adaptive"] is True
    (row,) = result["rows"]
    assert row["same_tokens"]
    assert row["tpot_ngram_ms"] > 0 and row["tpot_ngram_fixed_ms"] > 0
    assert row["tpot_ratio"] > 0 and row["tpot_ratio_fixed"] > 0
    # over every round (~30 decisions): the controller's probes draft (every 16th decision)
    # even where it measured drafting not to pay (a loaded machine)
    assert 0.0 < row["drafted_share"] <= 1.0
    assert 0.0 <= row["acceptance_rate_fixed"] <= 1.0
