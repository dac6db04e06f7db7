"""`tessera bench window`: the engine reads its two configs as a model windowed on every layer
and a full-attention twin; a tiny run reports both, the windowed request holding no more than
the manager's bound of blocks while decoding and the full one every block of its context."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_window

TINY = ["--context", "256", "--window", "32", "--layers", "3", "--hidden", "64", "--heads", "2",
        "--kv-heads", "1", "--intermediate", "128", "--vocab", "512", "--output-len", "8",
        "--rounds", "2", "--threads", "1"]  # fmt: skip


def test_the_configs_differ_only_in_the_window(tmp_path):
    from engine.models.loader import load_hf_config

    args = bench_window.build_parser().parse_args([])
    configs = bench_window.model_configs(args)
    assert {k: v for k, v in configs["window"].items() if k != "sliding_window"} == {
        k: v for k, v in configs["full"].items() if k != "sliding_window"
    }
    seen = {}
    for name, cfg in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        hf = load_hf_config(tmp_path / name)
        assert hf.num_hidden_layers == 30 and hf.hidden_size == 576
        assert hf.num_attention_heads == 9 and hf.num_key_value_heads == 3
        seen[name] = hf.kv_sliding_window()
    assert seen == {"window": 1024, "full": None}


def test_the_cli_knows_it():
    from api.cli.main import BENCHMARKS

    assert "window" in BENCHMARKS


@pytest.mark.parametrize(
    "argv, message",
    [(["--output-len", "2"], "--output-len"), (["--rounds", "0"], "--rounds"),
     (["--window", "0"], "--window"), (["--heads", "7"], "--hidden")],
)  # fmt: skip
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_window.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_tiny_run_frees_blocks_behind_the_window_only_in_the_windowed_model(tmp_path):
    out = tmp_path / "window.json"
    result = bench_window.main([*TINY, "--json", str(out)])
    assert json.loads(out.read_text()) == result
    w, f = result["models"]["window"], result["models"]["full"]
    assert w["kv_sliding_window"] == 32 and f["kv_sliding_window"] is None
    bound = math.ceil(32 / 16) + 1
    assert result["window_block_bound"] == bound
    for r in (w, f):
        assert r["output_tokens"] == 8  # ignore_eos: every token decoded
        assert r["decode_steps"] == 7 and r["tpot_ms"] > 0 and r["ttft_s"] > 0
        assert len(r["tpot_ms_rounds"]) == 2
        # held after the last decode step before the request finished: all but the last
        # sampled token computed
        assert r["computed_tokens"] == 256 + 8 - 2
        assert r["pool_used_blocks"] == r["kv_blocks_held"]  # one request: the pool's use
        assert r["kv_bytes_held"] == r["kv_blocks_held"] * r["kv_block_bytes"]
    assert w["kv_block_bytes"] == f["kv_block_bytes"] == 3 * 16 * 2 * 1 * 32 * 2  # bf16
    assert f["kv_blocks_held"] == math.ceil(f["computed_tokens"] / 16) == 17
    assert w["kv_blocks_held"] <= bound and w["peak_decode_blocks"] <= bound
    assert f["peak_decode_blocks"] == 17
    ratio = result["ratio_window_over_full"]
    assert ratio["kv_blocks"] == round(w["kv_blocks_held"] / 17, 4) < 0.25
    assert ratio["kv_bytes"] == ratio["kv_blocks"] and ratio["tpot"] > 0
