"""The quantized kernels' correctness pass, where pytest may not be (the GPU image has none):
one Row a case, for benchmarks/gpu/quant.py's table and the device check's section 6."""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Row:
    shape: str
    m: int
    kind: str
    us: float | None = None
    bytes_moved: int = 0
    bandwidth: float | None = None  # bytes / s
    share_of_copy: float | None = None
    rel_err: float | None = None
    note: str = ""


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


CHECK_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}  # as tests/engine/kernels' tests


def check_kernels(rows: list[Row], device: torch.device) -> None:
    """The kernels' correctness where pytest may not be (the GPU image has none): W4A16 and
    W8A16 over the layouts (groups 32/128/channel, sym/asym, act-order raw and repacked,
    bf16/fp16, decode rows with split-K and prefill rows) against dequantize_reference, the
    per-token fp8 quantization kernel byte for byte against torch, and fp8_linear against
    W8A8 in fp32. One row each; a failure says FAILED in its note."""
    from engine.kernels import fp8
    from engine.kernels.triton import quant_gemm as qg

    cuda = device.type == "cuda"
    k, n, ms = (1024, 1000, (1, 16, 100)) if cuda else (256, 72, (1, 20))
    g = torch.Generator().manual_seed(0)
    cases = [
        (bits, group, sym, act, torch.bfloat16)
        for bits in (4, 8)
        for group, sym, act in (
            (128, False, None), (32, True, None), (-1, False, None),
            (128, False, "raw"), (128, True, "repacked"),
        )
    ] + [(4, 128, False, "repacked", torch.float16), (8, 64, False, None, torch.float16)]  # fmt: skip
    for bits, group, sym, act, dtype in cases:
        groups = 1 if group <= 0 else k // group
        q = torch.randint(0, 1 << bits, (k, n), generator=g, dtype=torch.int32)
        qweight = qg.pack_int(q, bits).to(device)
        scales = ((torch.rand(groups, n, generator=g) + 0.5) / (1 << bits)).to(dtype).to(device)
        zeros = None
        if not sym:
            zeros = torch.randint(0, 1 << bits, (groups, n), generator=g, dtype=torch.int32)
            zeros = zeros.to(device)
        g_idx = None
        if act:
            plain = torch.arange(k, dtype=torch.int32) // (k if group <= 0 else group)
            g_idx = plain[torch.randperm(k, generator=g)].to(device)
        w = qg.dequantize_reference(qweight, scales, zeros, g_idx, bits, group).to(dtype)
        packed = qg.repack_for_kernel(qweight, scales, zeros, g_idx, bits, group)
        label = f"check w{bits}a16 g{group} {'sym' if sym else 'asym'}"
        label += f"{' act-order ' + act if act else ''} {str(dtype).removeprefix('torch.')}"
        for m in ms:
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            ref = x.double() @ w.double()
            row = Row("check", m, label)
            try:
                if act == "repacked":
                    y = qg.quant_gemm(x, packed)
                else:
                    y = qg.w_int_gemm(x, qweight, scales, zeros, g_idx, bits, group)
                row.rel_err = rel_err(y, ref)
                row.note = "ok" if row.rel_err <= CHECK_TOL[dtype] else "FAILED"
            except Exception as e:
                traceback.print_exc()
                row.note = f"ERROR {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
    # fp8: the per-token quantization (the Triton kernel on CUDA), then the linear
    x = (torch.randn(37, k, generator=g) * 3).to(torch.bfloat16).to(device)
    row = Row("check", 37, "check fp8 per-token quant (kernel vs torch bytes)")
    try:
        xq, xs = fp8.per_token_quant_fp8(x)
        want_q, want_s = fp8.per_token_quant_fp8_torch(x)
        same = torch.equal(xq.view(torch.uint8), want_q.view(torch.uint8))
        row.note = "ok" if same and torch.equal(xs, want_s) else "FAILED (bytes or scales differ)"
    except Exception as e:
        traceback.print_exc()
        row.note = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    rows.append(row)
    w = torch.randn(n - n % 16, k, generator=g).to(torch.bfloat16).to(device) * 0.05
    w_fp8, w_scale = fp8.quantize_weight_fp8(w)
    path = "_scaled_mm" if fp8.supports_fp8_matmul(device) else "weight-only"
    for static in (False, True):
        row = Row("check", 37, f"check fp8 linear ({path}, {'static' if static else 'dynamic'})")
        try:
            input_scale = (x.float().abs().max() / 448.0).item() if static else None
            y = fp8.fp8_linear(x, w_fp8, w_scale, input_scale)
            if path == "_scaled_mm":
                ref = fp8.fp8_linear_reference(x, w_fp8, w_scale, input_scale)
            else:
                ref = x.double() @ fp8.dequantize_fp8(w_fp8, w_scale, torch.float64).t()
            row.rel_err = rel_err(y, ref)
            row.note = "ok" if row.rel_err <= CHECK_TOL[torch.bfloat16] else "FAILED"
        except Exception as e:
            traceback.print_exc()
            row.note = f"ERROR {type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
