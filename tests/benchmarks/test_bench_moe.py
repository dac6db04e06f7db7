"""`tessera bench moe`: its two models have equal active parameters, the engine reads their
configs as a mixture of experts and a dense model, and a tiny run times both."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_moe

TINY = ["--hidden", "128", "--layers", "2", "--heads", "2", "--kv-heads", "1",
        "--expert-intermediate", "64", "--vocab", "512"]  # fmt: skip


@pytest.mark.parametrize("dense", ["llama", "qwen3"])
def test_the_models_have_equal_active_parameters(dense, tmp_path):
    from engine.models.loader import load_hf_config

    args = bench_moe.build_parser().parse_args(["--dense", dense])
    configs = bench_moe.model_configs(args)
    moe, flat = (bench_moe.parameter_counts(configs[n]) for n in ("moe", "dense"))
    router = args.layers * args.hidden * args.experts
    assert moe["layers_active"] == flat["layers_active"] + router
    assert moe["layers_total"] > 2 * moe["layers_active"]
    assert moe["embedding_and_head"] == flat["embedding_and_head"]
    for name, cfg in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        hf = load_hf_config(tmp_path / name)
        assert hf.hidden_size == 512 and hf.num_hidden_layers == 4
        if name == "moe":
            assert hf.num_experts == 8 and hf.num_experts_per_tok == 2
            assert hf.moe_intermediate_size == 512
            assert all(hf.is_moe_layer(i) for i in range(4))
        else:
            assert hf.num_experts == 0 and hf.intermediate_size == 1024


@pytest.mark.parametrize(
    "argv, message",
    [(["--top-k", "9"], "--top-k"), (["--heads", "7"], "--hidden"),
     (["--batch-sizes", "0"], "--batch-sizes")],
)  # fmt: skip
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_moe.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_run_times_both_models(tmp_path):
    out = tmp_path / "moe.json"
    result = bench_moe.main(
        [*TINY, "--batch-sizes", "1", "8", "--context", "8", "24", "--steps", "2",
         "--warmup", "1", "--threads", "1", "--json", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text())["paths"].keys() == {"moe", "dense"}
    for res in result["paths"].values():
        assert "error" not in res, res
        assert [r["batch_size"] for r in res["rows"]] == [1, 8]
        for r in res["rows"]:
            assert 0 < r["best_ms"] <= r["median_ms"]
            assert "tokens" not in r
    assert all(r["moe_over_dense"] > 0 for r in result["paths"]["moe"]["rows"])
    assert all(r["moe_over_dense_best"] > 0 for r in result["paths"]["moe"]["rows"])
