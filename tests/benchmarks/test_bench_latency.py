"""`tessera bench latency`: a run on a tiny model reports both sides' percentiles and the
ratio, every timed batch having produced all its tokens."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_latency


def test_summary_percentiles():
    s = bench_latency.summary([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s["mean_s"] == 3.0 and s["p50_s"] == 3.0 and s["p10_s"] == 1.0 and s["p99_s"] == 5.0


def test_bad_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        bench_latency.main(["--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_on_a_tiny_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--batch-size", "3"]
    argv += ["--input-len", "8", "--output-len", "6", "--num-iters-warmup", "1"]
    argv += ["--num-iters", "3", "--json", str(out)]
    result = bench_latency.main(argv)
    assert json.loads(out.read_text()) == result
    for side in ("tessera", "hf"):
        assert 0 < result[side]["p10_s"] <= result[side]["p50_s"] <= result[side]["p99_s"]
    assert result["ratio_p50"] > 0
