"""`tessera bench lora`: a run on a tiny model reports a row per batch size and adapter count;
the LoRA engine's base rows decode the base engine's tokens, an adapter changes them; the
swap table times a load and a slot copy per adapter (the vocabulary's adapter the larger)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_lora


def test_bad_arguments_are_rejected(capsys):
    for argv in (
        ["--streams", "0"],
        ["--adapters", "-1"],
        ["--ranks", "x"],
        ["--output-len", "2"],
        ["--rounds", "0"],
        ["--streams", "2", "--adapters", "4"],
        ["--swap-rank", "0"],
        ["--swap-repeats", "0"],
    ):
        with pytest.raises(SystemExit) as e:
            bench_lora.main(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_spread_is_round_robin():
    a, b = object(), object()
    assert bench_lora.spread([a, b], None, 3) == [None] * 3
    assert bench_lora.spread([a, b], 0, 2) == [None, None]
    assert bench_lora.spread([a, b], 2, 5) == [a, b, a, b, a]


def test_the_cli_knows_it():
    from api.cli.main import BENCHMARKS

    assert "lora" in BENCHMARKS


@pytest.mark.slow
def test_a_run_on_a_tiny_model(tiny_llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--streams", "2,3"]
    argv += ["--adapters", "0,1,2", "--output-len", "6", "--rounds", "1", "--json", str(out)]
    result = bench_lora.main(argv)
    assert json.loads(out.read_text()) == result
    rows = result["rows"]
    assert [(r["streams"], r["adapters"]) for r in rows] == [
        (2, 0),
        (2, 1),
        (2, 2),
        (3, 0),
        (3, 1),
        (3, 2),
    ]
    for r in rows:
        assert r["step_base_ms"] > 0 and r["step_lora_ms"] > 0 and r["ratio"] > 0
        assert r["decode_steps"] >= 1
        assert r["ranks"] == [8, 16][: r["adapters"]]
        # No adapter: exactly the base tokens; with adapters the deltas change them.
        assert r["same_tokens_as_base"] == (r["adapters"] == 0)
    _check_swaps(result["swap"], 16)


def _check_swaps(swaps: list[dict], rank: int) -> None:
    assert [s["adapter"] for s in swaps] == ["q/k/v/o, gate/up/down", "+ embed_tokens, lm_head"]
    for s in swaps:
        assert s["rank"] == rank and s["load_ms"] > 0 and s["to_slot_ms"] > 0
    assert swaps[1]["shard_mib"] > swaps[0]["shard_mib"] > 0


def test_swap_only(tiny_llama_dir, tmp_path):
    out = tmp_path / "swap.json"
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--swap-only"]
    result = bench_lora.main([*argv, "--swap-rank", "8", "--swap-repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result and "rows" not in result
    _check_swaps(result["swap"], 8)


@pytest.mark.slow
def test_a_run_with_expert_adapters(tiny_llama_dir, tmp_path):
    """--experts: the model's shape as a Qwen3-MoE, adapters on attention and every expert,
    B = 0: the base's tokens (and routing), whatever the adapters."""
    argv = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--streams", "2"]
    argv += ["--adapters", "0,1", "--output-len", "5", "--rounds", "1", "--experts", "4"]
    result = bench_lora.main(argv)
    assert result["model"].endswith("as Qwen3-MoE, 4 experts top-2")
    assert result["target_parameters"] == bench_lora.EXPERT_PARAMETERS
    assert [(r["adapters"], r["same_tokens_as_base"]) for r in result["rows"]] == [
        (0, True),
        (1, True),
    ]
    assert result["swap"] == []
