"""`tessera bench serve`: prompt generation, the statistics, and a run against llama.cpp's
server (any OpenAI-compatible server must do; ours is covered in test_server.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_serve
from benchmarks.bench_serve import RequestResult, make_prompts, summarize


def test_prompts_are_distinct_and_reproducible():
    a = make_prompts(50, 16, seed=0)
    assert len(set(a)) == 50
    assert a == make_prompts(50, 16, seed=0)
    assert a != make_prompts(50, 16, seed=1)
    assert all(len(p.split()) == 16 for p in a)


def test_prefix_dataset_shares_its_prefix():
    prompts = make_prompts(5, 8, seed=0, dataset="prefix", prefix_len=32)
    prefixes = {" ".join(p.split()[:32]) for p in prompts}
    assert len(prefixes) == 1 and len(set(prompts)) == 5
    with pytest.raises(ValueError, match="dataset"):
        make_prompts(1, 1, seed=0, dataset="sharegpt")


def test_json_schema_goes_on_every_request(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for value in (json.dumps(schema), str(path)):
        args = bench_serve.build_parser().parse_args(["--json-schema", value])
        args.json_schema = bench_serve.load_schema(args.json_schema)
        args.model = "m"
        chat = bench_serve._payload(args, "hi", chat=True)
        assert chat["response_format"]["json_schema"]["schema"] == schema
        assert bench_serve._payload(args, "hi", chat=False)["structured_outputs"] == {
            "json": schema
        }
    args = bench_serve.build_parser().parse_args([])
    args.model = "m"
    body = bench_serve._payload(args, "hi", chat=True)
    assert "response_format" not in body and "structured_outputs" not in body


def test_summary_statistics():
    results = [
        # 5 tokens: ttft 100 ms, then 4 gaps of 50 ms -> latency 300 ms, tpot 50 ms
        RequestResult(True, 10, 5, ttft=0.1, latency=0.3, itl=[0.05] * 4),
        # 3 tokens: ttft 200 ms, gaps 100 ms -> latency 400 ms, tpot 100 ms
        RequestResult(True, 20, 3, ttft=0.2, latency=0.4, itl=[0.1] * 2),
        RequestResult(False, error="HTTP 503"),
    ]
    s = summarize(results, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0
    assert s["mean_ttft_ms"] == pytest.approx(150)
    assert s["median_tpot_ms"] == pytest.approx(75)
    assert s["mean_itl_ms"] == pytest.approx((4 * 50 + 2 * 100) / 6)
    assert s["p99_e2el_ms"] == pytest.approx(399, abs=0.01)
    assert s["errors"] == ["HTTP 503"]


@pytest.mark.slow
def test_against_llamacpp_server():
    pytest.importorskip("xllamacpp", reason="benchmark-only dependency")
    from benchmarks.llamacpp_server import LlamaCppServer

    with LlamaCppServer(parallel=2, threads=2, ctx_per_slot=256) as url:
        s = bench_serve.main(
            [
                "--base-url",
                url,
                "--num-prompts",
                "2",
                "--max-concurrency",
                "2",
                "--random-input-len",
                "8",
                "--random-output-len",
                "8",
                "--ignore-eos",
            ]
        )
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["total_output_tokens"] == 16
    assert s["mean_ttft_ms"] > 0 and s["mean_tpot_ms"] > 0
