"""The device check's newer sections (§6 quantized GEMMs, §7 fused MoE, §8 batched LoRA, §9
speculative verification) run their whole logic on the CPU with the quick plan's tiny shapes,
the Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py): their rows, results and
summary line come out, and their correctness checks hold (times mean nothing here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.gpu.check import Check  # noqa: E402
from benchmarks.gpu.plan import QUICK  # noqa: E402
from benchmarks.gpu.report import Budget, Report, SectionRecord  # noqa: E402

CPU = torch.device("cpu")


def run_section(fn, num: int, tmp_path, plan=QUICK, seconds: float = 600) -> Report:
    report = Report()
    report.sections[num] = SectionRecord(f"§{num}")
    chk = Check(plan, CPU, tmp_path, report)
    fn(chk, report, Budget(seconds))
    return report


def test_fused_moe_section_times_each_batch_and_checks_the_reference(tmp_path):
    from benchmarks.gpu.moe import call_bytes, section_moe

    report = run_section(section_moe, 7, tmp_path)
    rec = report.sections[7]
    timed = [r for r in rec.results if "seconds" in r]
    assert [r["batch"] for r in timed] == list(QUICK.moe_batches)
    assert all(r["seconds"] > 0 and r["bytes_per_s"] > 0 for r in timed)
    (checked,) = [r for r in rec.results if "rel_err" in r]
    assert checked["rel_err"] < 3e-2
    assert rec.goal.endswith(": met") and "B=1" in rec.key
    # 8 experts of 3 x 64 x 32 bf16 weights: a token with top-2 touches two of them
    ids = torch.tensor([[0, 3]])
    assert call_bytes(ids, 64, 32) == 2 * 3 * 64 * 32 * 2 + 2 * 64 * 2


def test_fused_moe_section_skips_with_a_line_once_its_budget_is_spent(tmp_path):
    from benchmarks.gpu.moe import section_moe

    report = run_section(section_moe, 7, tmp_path, seconds=0)
    assert [r.result for r in report.rows] == ["skipped: section budget spent"]
    assert report.sections[7].key == "nothing measured"


def test_lora_section_compares_eight_adapters_with_none_per_linear(tmp_path):
    from benchmarks.gpu.lora import section_lora

    plan = dataclasses.replace(QUICK, lora_adapters=3, lora_rows=7)  # uneven groups
    report = run_section(section_lora, 8, tmp_path, plan=plan)
    rec = report.sections[8]
    assert [r["linear"] for r in rec.results] == list(plan.lora_linears)
    assert all(r["base_s"] > 0 and r["with_lora_s"] > 0 for r in rec.results)
    assert all(r["rel_err"] < 2e-2 for r in rec.results)
    assert rec.goal.endswith(": met") and "3 adapters rank 8" in rec.key
    step = report.rows[-1]
    assert step.check.startswith("decode step's linears, B=7: 3 adapters vs none")


def test_lora_batch_split_covers_every_row_once(tmp_path):
    from benchmarks.gpu.lora import make_layer

    gen = torch.Generator().manual_seed(0)
    _, ranges = make_layer(32, (16, 8), 3, 4, 7, CPU, gen)
    rows = [r for _, start, n in ranges for r in range(start, start + n)]
    assert rows == list(range(7)) and [slot for slot, _, _ in ranges] == [0, 1, 2]


def test_quant_section_checks_then_times_the_plan_linears(tmp_path):
    from benchmarks.gpu.quant import section_quant

    plan = dataclasses.replace(QUICK, quant_linears={"qkv": (256, 384)}, quant_rows=(1,))
    report = run_section(section_quant, 6, tmp_path, plan=plan)
    rec = report.sections[6]
    assert report.rows[0].check == "quant kernels correctness"
    ok, total = report.rows[0].result.split()[0].split("/")
    assert ok == total and int(total) > 20
    kinds = {r["kind"] for r in rec.results if r["us"] is not None}
    assert "bf16 torch.mm" in kinds and "w4a16 g128 asym, reshape (triton)" in kinds
    assert rec.goal == "all checks ok: met"


def test_spec_section_times_verify_and_plain_steps_on_one_engine(tmp_path):
    from benchmarks.gpu.spec import section_spec

    plan = dataclasses.replace(QUICK, spec_batches=(2,))
    report = run_section(section_spec, 9, tmp_path, plan=plan)
    (res,) = report.sections[9].results
    assert res["batch"] == 2 and res["drafts"] == QUICK.spec_tokens
    assert len(res["verify_steps"]) >= 2 and len(res["plain_steps"]) >= 2
    assert res["verify_s"] > 0 and res["plain_s"] > 0
    assert "B=2" in report.sections[9].key


def test_always_draft_proposes_k_tokens_within_the_schedulers_limit():
    from benchmarks.gpu.spec import AlwaysDraft

    assert AlwaysDraft(3).propose([5, 9, 11], 100) == [11, 11, 11]  # the step's budget - 1
    assert AlwaysDraft(3).propose([5, 9], 2) == [9, 9]
    assert AlwaysDraft(3).propose([5], 0) == []
