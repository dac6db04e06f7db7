from __future__ import annotations

import json

from benchmarks.bench_scheduler import main


def test_bench_scheduler_runs_small(capsys):
    assert (
        main(
            [
                "--num-requests",
                "8",
                "--prompt-len",
                "40",
                "--shared-prefix-len",
                "16",
                "--steps",
                "20",
                "--warmup",
                "5",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["num_requests"] == 8 and result["steps"] == 20
    assert result["p50_us"] > 0 and result["mean_us"] > 0
    assert 0 <= result["prefix_hit_rate"] < 1


def test_bench_scheduler_human_output(capsys):
    main(
        [
            "--num-requests",
            "4",
            "--prompt-len",
            "20",
            "--steps",
            "5",
            "--warmup",
            "1",
            "--no-prefix-caching",
        ]
    )
    out = capsys.readouterr().out
    assert "schedule()+update_from_output()" in out and "prefix caching off" in out
