"""benchmarks/gpu/, the device check's runner, §1-§5 and §10: it imports without CUDA and
without the web stack, its workload is reproducible, and its CPU smoke run (`--quick --device cpu`)
prints the summary table first, then the details, and the JSON with every section run
(triton and fp8 reported as not available where this branch or the CPU lacks them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu.models import decode_weight_bytes, kv_bytes_per_token
from benchmarks.gpu.run import RUN_ORDER, SECTIONS, build_parser, ordered
from benchmarks.gpu.throughput import sharegpt_like_workload

ROOT = Path(__file__).resolve().parents[3]
# What the GPU machine lacks: any import of these fails, as it would there.
BLOCK_WEB_STACK = (
    "import sys\nfor name in ('msgspec', 'litestar', 'sqlalchemy'):\n    sys.modules[name] = None\n"
)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)  # the smoke run is the CPU's, not the interpreter's
    return env


def test_imports_without_the_web_stack():
    code = BLOCK_WEB_STACK + (
        "import benchmarks.gpu.run\n"
        "for n in benchmarks.gpu.run.SECTIONS: benchmarks.gpu.run.SECTIONS[n][1]()\n"
        "import engine.llm, engine.worker.model_runner\n"  # what the sections import
        "from engine import LLM\n"
        "assert sys.modules.get('msgspec') is None\n"
        "print('imported')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "imported"


def test_sharegpt_like_workload_is_fixed_by_its_seed():
    a = sharegpt_like_workload(1000, 250, 200, max_len=8192, vocab_size=128256, seed=0)
    assert a == sharegpt_like_workload(1000, 250, 200, max_len=8192, vocab_size=128256, seed=0)
    assert a != sharegpt_like_workload(1000, 250, 200, max_len=8192, vocab_size=128256, seed=1)
    prompts, outs = a
    ins = [len(p) for p in prompts]
    assert 200 <= np.mean(ins) <= 300 and 160 <= np.mean(outs) <= 240
    assert min(ins) >= 4 and min(outs) >= 4
    assert all(i + o <= 8192 for i, o in zip(ins, outs, strict=True))
    assert len(set(ins)) > 100  # a spread of lengths, not one
    assert all(2 <= t < 128256 for p in prompts for t in p)  # no special ids (0, 1)


def test_llama3_8b_byte_counts():
    from benchmarks.gpu.plan import LLAMA3_8B

    # 32 x (4096 x 6144 + 4096 x 4096 + 3 x 4096 x 14336) + 128256 x 4096 weights, bf16
    assert decode_weight_bytes(LLAMA3_8B) == 2 * (32 * 218_103_808 + 525_336_576)
    assert kv_bytes_per_token(LLAMA3_8B) == 131_072  # 32 layers x K, V x 8 heads x 128 x 2 B


def test_quick_cpu_smoke_run(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code = BLOCK_WEB_STACK + (
        "import runpy\n"
        "sys.argv = ['gpu', '--quick', '--device', 'cpu', '--sections', '1', '2', '3', '4', '5']\n"
        "runpy.run_module('benchmarks.gpu', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**_env(), "OUT": str(out_dir)},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    # the summary first: one line a section, in the run's order, then the details
    assert lines[0] == "| § | section | status | key figure | goal |"
    summary = [line.split("|")[1:-1] for line in lines[1:6]]
    assert [cells[0].strip() for cells in summary] == ["1", "2", "3", "4", "5"]
    assert all(cells[2].strip().startswith("ok") and cells[3].strip() for cells in summary)
    assert "tok/s" in summary[3][3] and "output tok/s" in summary[4][3]
    assert lines[6] == "| § | check | result | vs ceiling / goal | note |"
    assert {line.split("|")[1].strip() for line in lines[7:]} == {"1", "2", "3", "4", "5"}
    assert "ERROR" not in proc.stdout

    result = json.loads((out_dir / "gpu_check.json").read_text())
    assert result["meta"]["plan"] == "quick"
    sections = result["sections"]
    assert [sections[n]["status"] for n in "12345"] == ["ok"] * 5, sections
    assert result["ceilings"]["copy_bytes_per_s"] > 0

    checks = {r["check"]: r for r in result["rows"]}
    # the torch reference is held to the fp64 one on every case; triton is not on the CPU
    torch_bf16 = checks["correctness torch, bf16 KV"]
    assert torch_bf16["versus"].endswith(": ok"), torch_bf16
    errors = [
        r["rel_err"]
        for r in sections["2"]["results"]
        if (r["backend"], r["kv"]) == ("torch", "bf16") and "rel_err" in r
    ]
    assert len(errors) == 10 and max(errors) < 2e-2  # 2 batches x 3 contexts, decode + mixed
    triton_bf16 = checks["correctness triton, bf16 KV"]
    assert triton_bf16["result"] == "not available" or triton_bf16["versus"].endswith(": ok")

    timed = [r for r in sections["3"]["results"] if r.get("seconds")]
    assert {(r["batch"], r["context"]) for r in timed} == {(1, 64), (4, 64), (1, 256), (4, 256)}
    assert all(r["backend"] == "torch" and r["kv_bytes_per_s"] > 0 for r in timed)

    decode = [r for r in sections["4"]["results"] if "tok_s" in r]
    assert [r["batch"] for r in decode] == [1, 4] and all(r["tok_s"] > 0 for r in decode)
    prefill = [r for r in sections["4"]["results"] if "prefill" in r]
    assert [r["tokens"] for r in prefill] == [128, 511]  # one chunk; a prompt in chunks of 128
    assert all(r["seconds"] > 0 and r["flops_per_s"] > 0 for r in prefill)

    (offline,) = sections["5"]["results"]
    assert offline["complete"] and offline["finished"] == offline["requests"] == 16
    assert offline["output_tok_s"] > 0


def test_the_serving_section_on_the_cpu(tmp_path):
    """§10's quick run: a real `tessera serve` (a subprocess on loopback, the tiny dummy model)
    against the bench-serve client at 4 and 16 streams, then the same requests offline:
    every request served with exactly max_tokens, the share the ratio of the two figures."""
    path = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--quick", "--device", "cpu",
         "--sections", "serving", "--json", str(path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    section = json.loads(path.read_text())["sections"]["10"]
    assert section["status"] == "ok", section
    served = [r for r in section["results"] if "concurrency" in r]
    assert [r["concurrency"] for r in served] == [4, 16]
    for r in served:
        assert r["completed"] == 2 * r["concurrency"] and r["failed"] == 0
        assert r["total_output_tokens"] == 16 * r["completed"]  # ignore_eos: all max_tokens
        assert r["output_throughput"] > 0 and r["median_ttft_ms"] > 0
    (share,) = [r for r in section["results"] if "share" in r]
    assert share["served_tok_s"] == served[-1]["output_throughput"]
    assert share["share"] == pytest.approx(share["served_tok_s"] / share["offline_tok_s"])
    assert "of offline at 16 streams" in section["goal"]


def test_the_serving_section_says_so_without_the_web_stack(tmp_path):
    code = BLOCK_WEB_STACK + (
        "import runpy\n"
        "sys.argv = ['gpu', '--quick', '--device', 'cpu', '--sections', 'serving']\n"
        "runpy.run_module('benchmarks.gpu', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not measured: no web stack" in proc.stdout
    assert "no web stack here: litestar, msgspec, sqlalchemy (carry" in proc.stdout


def test_sections_are_chosen_by_number_or_name_and_run_in_the_run_order():
    args = build_parser().parse_args(["--sections", "5", "moe", "1", "lora", "4"])
    assert ordered(args.sections) == [1, 7, 8, 4, 5]  # kernels first; §5 right after §4
    assert ordered(build_parser().parse_args([]).sections) == list(RUN_ORDER)
    assert sorted(RUN_ORDER) == sorted(SECTIONS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--sections", "nope"])


def test_old_entry_points_still_parse_their_flags():
    """benchmarks/gpu_check.py and gpu_quant.py are kept for the command lines on record."""
    for script, flags in (
        ("gpu_check.py", "--quick --sections 1 2"),
        ("gpu_quant.py", "--quick --sweep"),
    ):
        proc = subprocess.run(
            [sys.executable, f"benchmarks/{script}", *flags.split(), "--help"],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "--quick" in proc.stdout


CUDA_MARK = re.compile(r"^(@pytest\.mark\.cuda|pytestmark = pytest\.mark\.cuda)", re.M)


def _session_tests() -> list[str]:
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    block = script.split("tests=(", 1)[1].split("\n)", 1)[0]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_session_runs_every_cuda_marked_test_file_and_the_new_runner():
    listed = _session_tests()
    files = {entry.split("::")[0] for entry in listed}
    assert all((ROOT / f).is_file() for f in files), files
    marked = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if CUDA_MARK.search(path.read_text())
    }
    assert marked <= files, marked - files
    # the kernels' own tests before the engines' and the attention shapes' compiles
    assert listed[-1] == "tests/engine/kernels/test_triton_attention.py"
    assert listed.index("tests/engine/kernels/test_triton_fused_moe.py") < listed.index(
        "tests/engine/worker/test_cuda_graph.py"
    )
    assert "python3 -m benchmarks.gpu " in (ROOT / "benchmarks" / "gpu_session.sh").read_text()


def test_the_session_errand_runs_on_a_cpu_and_ends_with_the_summary(tmp_path):
    """The whole script, its tests stopped at their limit, the check's chosen sections run
    quick on the CPU: the summary table is the output's last table (the tail comes back)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {
        **_env(),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "OUT": str(tmp_path / "out"),
        "GPU_CHECK_FLAGS": "--quick --device cpu",
    }
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "3", "120", "ceilings", "lora"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "tests: exit" in out and "gpu_check: exit 0" in out
    summary = out.index("| § | section | status | key figure | goal |")
    assert out.index("| § | check | result |") < summary
    rows = [line for line in out[summary:].splitlines() if line.startswith("| ")][1:]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "8"]
    assert out.rstrip().splitlines()[-1].startswith("sections: §1 ok")
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["meta"]["sections"] == [1, 8]
    assert result["summary"]["8"]["goal"] == "matches the torch apply: met"


def test_a_section_stuck_past_its_budget_is_stopped_and_the_next_one_runs(monkeypatch, tmp_path):
    import dataclasses
    import signal
    import time

    import torch

    from benchmarks.gpu import run
    from benchmarks.gpu.check import Check
    from benchmarks.gpu.plan import QUICK
    from benchmarks.gpu.report import Report

    def stuck(chk, out, budget):
        time.sleep(30)  # one long call that never looks at its budget

    def quick(chk, out, budget):
        out.summary(2, "done")

    monkeypatch.setattr(run, "SECTIONS", {1: ("stuck", lambda: stuck), 2: ("next", lambda: quick)})
    monkeypatch.setattr(run, "RUN_ORDER", (1, 2))
    monkeypatch.setattr(run, "GRACE_S", 1)
    plan = dataclasses.replace(QUICK, budgets={1: 0.5, 2: 5})
    report = Report()
    old = signal.signal(signal.SIGALRM, run._on_alarm)
    try:
        started = time.monotonic()
        chk = Check(plan, torch.device("cpu"), tmp_path, report)
        run.run_sections([1, 2], plan, 60, started, chk, report)
        assert time.monotonic() - started < 10
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert report.sections[1].status == "error" and "TimeLimit" in report.sections[1].error
    assert report.sections[2].status == "ok" and report.sections[2].key == "done"
