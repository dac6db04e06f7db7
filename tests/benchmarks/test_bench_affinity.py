"""`tessera bench affinity` runs end to end on a tiny model (two replicas, nginx, Postgres;
bounded: 4 tenants, one round) and reports both modes."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_affinity
from tests.deploy.nginx_proxy import ensure_nginx

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_bench_affinity_runs_both_modes(tiny_llama_dir, tmp_path, capsys):
    ensure_nginx()
    out_json = tmp_path / "affinity.json"
    argv = [
        "--model", str(tiny_llama_dir), "--tenants", "4", "--system-words", "40",
        "--turns", "2", "--concurrency", "2", "--num-kv-blocks", "64", "--rounds", "1",
        "--max-model-len", "512", "--dtype", "float32", "--json", str(out_json),
    ]  # fmt: skip
    assert bench_affinity.main(argv) == 0
    out = capsys.readouterr().out
    assert "round 1 round_robin" in out and "round 1 affinity" in out
    assert "affinity / round robin: hit rate" in out
    summary = json.loads(out_json.read_text())
    for mode in ("round_robin", "affinity"):
        assert 0.0 <= summary[mode]["hit_rate"] <= 1.0
        assert summary[mode]["ttft_p99_ms"] >= summary[mode]["ttft_p50_ms"] > 0
