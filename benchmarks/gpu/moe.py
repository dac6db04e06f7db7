"""§7 fused MoE: engine.kernels.triton.fused_moe.fused_experts at real models' expert shapes
(the plan's: Qwen3-30B-A3B's 128 experts / top-8 / hidden 2048 / 768, Mixtral's 8 / top-2 /
4096 / 14336) and decode batches: microseconds a call, and the bytes it must touch (the
experts its tokens are routed to, x and the output) per second as a share of the copy
bandwidth, the ceiling a decode-sized MoE is held to. Routing is uniform (random router
logits through the engine's own select_experts). The smallest batch of each shape is also
checked against the torch reference (experts_cpu in float32 over the experts it touches)."""

from __future__ import annotations

import torch

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import best_seconds, free_memory
from benchmarks.gpu.report import SKIPPED, Budget, Report, fmt_bandwidth, share

TOLERANCE = 3e-2  # bf16 operands and intermediate, as the kernel's own tests


def expert_bytes(topk_ids: torch.Tensor, hidden: int, inter: int, elem: int = 2) -> int:
    """Weight bytes a call must read: w13 (2I x H) and w2 (H x I) of each distinct expert."""
    return int(torch.unique(topk_ids).numel()) * 3 * hidden * inter * elem


def call_bytes(topk_ids: torch.Tensor, hidden: int, inter: int, elem: int = 2) -> int:
    """Expert weights, plus x read and the output written (the intermediates stay small)."""
    return expert_bytes(topk_ids, hidden, inter, elem) + 2 * topk_ids.shape[0] * hidden * elem


def reference_error(x, w13, w2, weights, ids) -> float:
    """max|fused - ref| / max|ref|, ref = experts_cpu in float32 over the touched experts."""
    from engine.kernels.triton.fused_moe import fused_experts
    from engine.layers.moe import experts_cpu

    used, local = torch.unique(ids, return_inverse=True)
    ref = experts_cpu(x.float(), w13[used].float(), w2[used].float(), weights, local).double()
    got = fused_experts(x, w13, w2, weights, ids).double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@torch.inference_mode()
def section_moe(chk: Check, out: Report, budget: Budget) -> None:
    from engine.kernels.triton.fused_moe import fused_experts
    from engine.layers.moe import select_experts

    device, p = chk.device, chk.plan
    copy = chk.copy_bandwidth()
    target_s = 0.05 if device.type == "cuda" else 0.0
    gen = torch.Generator(device=device).manual_seed(7)
    keys, errors = [], []
    for name, (experts, top_k, hidden, inter) in p.moe_shapes.items():
        if budget.spent:
            out.row(7, f"moe {name}", SKIPPED)
            continue
        shape = f"{experts} experts top-{top_k}, hidden {hidden}, inter {inter}"
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device)
        w13 = w13.mul_(0.02).to(torch.bfloat16)
        w2 = torch.randn(experts, hidden, inter, generator=gen, device=device)
        w2 = w2.mul_(0.02).to(torch.bfloat16)
        shares = []
        for i, b in enumerate(p.moe_batches):
            if budget.spent:
                out.row(7, f"moe {name}, B={b}", SKIPPED)
                continue
            x = torch.randn(b, hidden, generator=gen, device=device).to(torch.bfloat16)
            logits = torch.randn(b, experts, generator=gen, device=device)
            weights, ids = select_experts(logits, top_k, renormalize=True)
            note = f"{int(torch.unique(ids).numel())}/{experts} experts touched"
            if i == 0:
                err = reference_error(x, w13, w2, weights, ids)
                errors.append(err)
                note += f"; rel err {err:.1e} (tol {TOLERANCE:.0e})"
                out.result(7, shape=name, batch=b, rel_err=err)
            t = best_seconds(
                lambda x=x, w=weights, ids=ids, w13=w13, w2=w2: fused_experts(x, w13, w2, w, ids),
                device,
                target_s=target_s,
            )
            nbytes = call_bytes(ids, hidden, inter)
            bw = nbytes / t
            shares.append((b, bw))
            out.row(
                7,
                f"moe {name}, B={b}",
                f"{t * 1e6:,.1f} µs",
                f"{fmt_bandwidth(bw)} = {share(bw, copy, 'copy')}",
                f"{shape}; {note}; {nbytes / 1e6:,.2f} MB touched",
            )
            out.result(
                7,
                shape=name,
                experts=experts,
                top_k=top_k,
                hidden=hidden,
                inter=inter,
                batch=b,
                seconds=t,
                bytes=nbytes,
                bytes_per_s=bw,
                share_of_copy=bw / copy if copy else None,
            )
        if shares:
            parts = ", ".join(f"B={b} {share(bw, copy, 'copy')}" for b, bw in shares)
            keys.append(f"{name}: {parts.replace(' of copy', '')}")
        del w13, w2
        free_memory()
    ok = bool(errors) and all(e <= TOLERANCE for e in errors)
    out.summary(
        7,
        "; ".join(keys) + " of copy" if keys else "nothing measured",
        "matches the torch reference: " + ("met" if ok else "NOT met"),
    )
    if errors and not ok:
        raise RuntimeError(f"fused MoE off the reference: rel err {max(errors):.2e}")
