"""§8 batched LoRA: what the multi-LoRA kernels (engine.kernels.triton.lora, through the
engine's own LoRALayer / LoRABatch) add to a decode step. For each of the plan's merged
linears (Llama-3-8B's qkv, o, gate_up, down) at the plan's rows, split evenly over the plan's
adapters (rank 16, every slice targeted): the base GEMM alone, and the base GEMM plus the
LoRA apply; the step's cost is the model's layers times their sum (the rest of a step is the
same with and without adapters). The Triton apply is also checked against the torch one (the
same slots, engine.lora.layers' grouped matmuls)."""

from __future__ import annotations

import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import best_seconds, free_memory
from benchmarks.gpu.report import SKIPPED, Budget, Report

TOLERANCE = 2e-2  # bf16 shrink rounded before its expand, as the reference does


def make_layer(in_features, sizes, adapters, rank, rows, device, gen):
    """A LoRALayer with `adapters` random rank-`rank` adapters, and the step's batch of
    `rows` rows split evenly over them (Triton kernels)."""
    from engine.lora.layers import LoRABatch, LoRALayer

    slices, row = [], 0
    for size in sizes:
        slices.append((row, size))
        row += size
    batch = LoRABatch(device, kernel="triton")
    layer = LoRALayer(batch, slices, in_features, adapters, rank, torch.bfloat16, device)
    for slot in range(adapters):
        parts = []
        for _, size in slices:
            a = torch.randn(rank, in_features, generator=gen, device=device) / in_features**0.5
            b = torch.randn(size, rank, generator=gen, device=device) / rank**0.5
            parts.append((a.to(torch.bfloat16), b.to(torch.bfloat16)))
        layer.set_slot(slot, parts)
    per = -(-rows // adapters)
    ranges = [(s, s * per, min(per, rows - s * per)) for s in range(adapters) if s * per < rows]
    batch.set(ranges)
    return layer, ranges


def torch_error(layer, ranges, x, y0) -> float:
    """max|triton - torch| / max|torch delta| of one apply over the same slots and rows."""
    from engine.lora.layers import LoRABatch

    got = layer.apply(x, y0.clone()).double()
    triton_batch = layer.batch
    ref_batch = LoRABatch(x.device, kernel="torch")
    ref_batch.set(ranges)
    layer.batch = ref_batch
    try:
        ref = layer.apply(x, y0.clone()).double()
    finally:
        layer.batch = triton_batch
    delta = (ref - y0.double()).abs().max().clamp_min(1e-30)
    return float((got - ref).abs().max() / delta)


@torch.inference_mode()
def section_lora(chk: Check, out: Report, budget: Budget) -> None:
    device, p = chk.device, chk.plan
    layers = p.model["num_hidden_layers"]
    rows, adapters, rank = p.lora_rows, p.lora_adapters, p.lora_rank
    target_s = 0.05 if device.type == "cuda" else 0.0
    gen = torch.Generator(device=device).manual_seed(8)
    base_total = lora_total = 0.0
    measured, errors = [], []
    for name, (in_features, sizes) in p.lora_linears.items():
        if budget.spent:
            out.row(8, f"lora {name}", SKIPPED)
            continue
        out_features = sum(sizes)
        w = (torch.randn(out_features, in_features, generator=gen, device=device) * 0.02).to(
            torch.bfloat16
        )
        x = torch.randn(rows, in_features, generator=gen, device=device).to(torch.bfloat16)
        layer, ranges = make_layer(in_features, sizes, adapters, rank, rows, device, gen)
        err = torch_error(layer, ranges, x, torch.mm(x, w.t()))
        errors.append(err)
        base = best_seconds(lambda x=x, w=w: torch.mm(x, w.t()), device, target_s=target_s)
        with_lora = best_seconds(
            lambda x=x, w=w, layer=layer: layer.apply(x, torch.mm(x, w.t())),
            device,
            target_s=target_s,
        )
        base_total += base
        lora_total += with_lora
        measured.append(name)
        out.row(
            8,
            f"lora {name} {in_features} -> {out_features}, {rows} rows, {adapters} adapters",
            f"{with_lora * 1e6:,.1f} µs vs {base * 1e6:,.1f} µs without",
            f"+{with_lora / base - 1:.0%}",
            f"rank {rank} on {len(sizes)} slice(s); rel err vs torch apply {err:.1e}",
        )
        out.result(
            8,
            linear=name,
            rows=rows,
            adapters=adapters,
            rank=rank,
            base_s=base,
            with_lora_s=with_lora,
            rel_err=err,
        )
        del w, x, layer
        free_memory()
    if not measured:
        out.summary(8, "nothing measured")
        return
    extra = lora_total / base_total - 1
    what = f"{layers} layers x ({', '.join(measured)})"
    out.row(
        8,
        f"decode step's linears, B={rows}: {adapters} adapters vs none",
        f"{lora_total * layers * 1e3:.2f} ms vs {base_total * layers * 1e3:.2f} ms",
        f"+{extra:.0%}",
        what,
    )
    ok = all(e <= TOLERANCE for e in errors)
    out.summary(
        8,
        f"B={rows}, {adapters} adapters rank {rank}: linears +{extra:.0%} "
        f"({lora_total * layers * 1e3:.2f} vs {base_total * layers * 1e3:.2f} ms a step)",
        "matches the torch apply: " + ("met" if ok else "NOT met"),
    )
    if not ok:
        raise RuntimeError(f"Triton LoRA off the torch apply: rel err {max(errors):.2e}")
