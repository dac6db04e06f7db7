"""The Triton shrink/expand kernels (engine.kernels.triton.lora) against the torch reference
(engine.lora.layers' grouped matmuls): ranks 8-64, uneven token groups, rows of the base
model between them, a slot whose layer is not targeted. Under TRITON_INTERPRET=1 without a
GPU (tests/engine/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.triton.lora import lora_shrink_expand
from engine.lora.layers import LoRABatch, LoRALayer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(batch, dtype, ranks, slices, in_features, seed):
    """A layer with random adapters in its slots, and each slot's (A, B) per slice. Slot 1
    skips the middle slice of a three-slice layer (an adapter of q and v alone)."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device(DEVICE)
    layer = LoRALayer(batch, slices, in_features, len(ranks), max(ranks), dtype, device)
    weights = []
    for slot, r in enumerate(ranks):
        if r == 0:
            layer.set_slot(slot, None)  # an adapter that does not target this layer
            weights.append(None)
            continue
        parts = []
        for i, (_, size) in enumerate(slices):
            a = torch.randn(r, in_features, generator=g) / in_features**0.5
            b = torch.randn(size, r, generator=g) / r**0.5
            skip = slot == 1 and len(slices) == 3 and i == 1
            parts.append(None if skip else (a.to(dtype).to(device), b.to(dtype).to(device)))
        layer.set_slot(slot, parts)
        weights.append(parts)
    return layer, weights


def _naive(x, y, ranges, weights, slices):
    """y[rows, slice] += x[rows] @ A^T @ B^T per request, per slice, in float64."""
    y = y.double()
    for slot, start, n in ranges:
        for (row, size), ab in zip(slices, weights[slot] or [None] * len(slices), strict=True):
            if ab is not None:
                a, b = (t.double() for t in ab)
                y[start : start + n, row : row + size] += x[start : start + n].double() @ a.T @ b.T
    return y


@pytest.mark.parametrize(
    ("dtype", "ranks", "slices"),
    [
        (torch.float32, [8, 16, 64], [(0, 48), (48, 16), (64, 16)]),  # qkv-like, 3 slices
        (torch.float32, [32, 0, 8], [(0, 40)]),
        (torch.float16, [16, 64, 8], [(0, 24), (24, 24)]),  # gate_up-like
    ],
)
def test_kernels_match_the_torch_reference(dtype, ranks, slices):
    torch.manual_seed(0)
    in_features, out = 64, sum(s for _, s in slices)
    num_rows = 45
    x = torch.randn(num_rows, in_features).to(dtype).to(DEVICE)
    y0 = torch.randn(num_rows, out).to(dtype).to(DEVICE)
    # uneven groups, split runs of one adapter, base rows between: (slot, first row, rows)
    ranges = [(0, 0, 1), (2, 1, 17), (1, 18, 3), (0, 24, 7), (2, 31, 1), (1, 40, 5)]
    ref_batch = LoRABatch(torch.device(DEVICE), "torch")
    ref_batch.set(ranges)
    ref, weights = _layer(ref_batch, dtype, ranks, slices, in_features, seed=1)
    want = ref.apply(x, y0.clone())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    naive = _naive(x, y0, ranges, weights, slices)
    torch.testing.assert_close(want.double(), naive, atol=tol, rtol=tol)  # the reference itself

    batch = LoRABatch(torch.device(DEVICE), "triton")
    batch.set(ranges)
    got = y0.clone()
    lora_shrink_expand(
        x, got, ref.a, ref.b, ref.width_t, ref.slice_off, ref.slice_rank, ref.slices,
        batch.token_rows, batch.seg_start, batch.seg_len, batch.seg_slot, batch.max_rows,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    base_rows = [18 + 3 + i for i in range(3)] + list(range(32, 40))
    assert torch.equal(got[base_rows], y0[base_rows]), "rows of the base model changed"
