"""`tessera bench decode`: the workload, argument checks, and a run of all three paths on a
tiny model whose greedy decode tokens must equal HF transformers' (float32)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks import bench_decode
from benchmarks.bench_decode import make_workload


def test_workload_is_reproducible_and_in_range():
    seqs = make_workload(50, 8, 40, vocab_size=384, seed=0)
    assert seqs == make_workload(50, 8, 40, vocab_size=384, seed=0)
    assert seqs != make_workload(50, 8, 40, vocab_size=384, seed=1)
    assert all(8 <= len(prompt) <= 40 for prompt, _ in seqs)
    assert all(0 <= t < 384 for prompt, nxt in seqs for t in [*prompt, nxt])
    # Batch size B takes the first B sequences: a smaller run is a prefix of a bigger one.
    assert make_workload(4, 8, 40, vocab_size=384, seed=0) == seqs[:4]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--context", "40", "8"], "--context"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_all_paths_on_a_tiny_model_agree_with_hf(tiny_llama_dir, tmp_path):
    out = tmp_path / "decode.json"
    result = bench_decode.main(
        ["--model", str(tiny_llama_dir), "--dtype", "float32", "--batch-sizes", "1", "4",
         "--context", "8", "40", "--steps", "2", "--warmup", "1", "--threads", "1",
         "--json", str(out)]
    )  # fmt: skip
    assert out.is_file()
    assert set(result["paths"]) == {"kernel", "torch", "hf"}
    assert result["machine"]["torch_threads"] == 1
    for name, res in result["paths"].items():
        assert "error" not in res, res
        assert res["torch_threads"] == 1
        assert [r["batch_size"] for r in res["rows"]] == [1, 4]
        for r in res["rows"]:
            assert 0 < r["best_ms"] <= r["median_ms"]
            assert r["median_tok_s"] > 0
            if name != "hf":  # the real reference: HF's greedy token for every sequence
                assert r["same_tokens_as_hf"] == r["batch_size"]
    assert result["paths"]["torch"]["attention"] == "torch"
    if shutil.which("cc") or shutil.which("gcc"):
        assert result["paths"]["kernel"]["attention"] == "compiled CPU kernel"
