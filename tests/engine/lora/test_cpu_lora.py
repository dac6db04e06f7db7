"""The CPU's batched LoRA kernel (engine.kernels.cpu.lora, lora.c) against the torch reference
(engine.lora.layers' grouped matmuls): float32 and bf16 activations, ranks 8-64, uneven and
split token groups, rows of the base model between them, a slot whose layer is not targeted
and one that skips a slice, and a step large enough to be split over threads."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import lora as cpu_lora
from engine.lora.layers import LoRABatch, LoRALayer

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="CPU kernels not built")


def _layer(batch, ranks, slices, in_features, seed):
    """A layer of float32 slots (the CPU's) with random adapters; slot 1 skips the middle
    slice of a three-slice layer (an adapter of q and v alone); rank 0: not targeted."""
    g = torch.Generator().manual_seed(seed)
    layer = LoRALayer(
        batch, slices, in_features, len(ranks), max(ranks), torch.float32, torch.device("cpu")
    )
    for slot, r in enumerate(ranks):
        if r == 0:
            layer.set_slot(slot, None)
            continue
        parts = []
        for i, (_, size) in enumerate(slices):
            a = torch.randn(r, in_features, generator=g) / in_features**0.5
            b = torch.randn(size, r, generator=g) / r**0.5
            skip = slot == 1 and len(slices) == 3 and i == 1
            parts.append(None if skip else (a, b))
        layer.set_slot(slot, parts)
    return layer


def _apply(kernel, ranks, slices, in_features, ranges, x, y0):
    batch = LoRABatch(torch.device("cpu"), kernel)
    batch.set(ranges)
    layer = _layer(batch, ranks, slices, in_features, seed=1)
    return layer.apply(x, y0.clone())


CASES = [
    # (ranks per slot, slices (first row, rows), in_features)
    ([8, 16, 64], [(0, 48), (48, 16), (64, 16)], 64),  # qkv-like, 3 slices
    ([32, 0, 8], [(0, 40)], 72),  # a slot not targeted; K not a multiple of 16
    ([16, 64, 8, 16], [(0, 24), (24, 24)], 64),  # gate_up-like
]
# uneven groups, split runs of one adapter, base rows between: (slot, first row, rows)
RANGES = [(0, 0, 1), (2, 1, 17), (1, 18, 3), (0, 24, 7), (2, 31, 1), (1, 40, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ranks", "slices", "in_features"), CASES)
def test_the_kernel_matches_the_torch_reference(dtype, ranks, slices, in_features):
    torch.manual_seed(0)
    out, num_rows = sum(s for _, s in slices), 45
    x = torch.randn(num_rows, in_features).to(dtype)
    y0 = torch.randn(num_rows, out).to(dtype)
    want = _apply("torch", ranks, slices, in_features, RANGES, x, y0)
    got = _apply("cpu", ranks, slices, in_features, RANGES, x, y0)
    # bf16: the same float32 sums in another order, and the torch path's gathered rows round
    # their delta to bf16 before adding it (this kernel rounds once)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert not torch.equal(got, y0), "no delta applied"
    base_rows = [21, 22, 23, *range(32, 40)]  # in none of RANGES
    assert torch.equal(got[base_rows], y0[base_rows]), "rows of the base model changed"


def test_a_step_split_over_threads_matches_the_reference():
    """Enough work to fork (LORA_PAR_WORK), eight adapters over 64 rows, a strided x."""
    torch.manual_seed(1)
    slices, in_features = [(0, 576), (576, 192), (768, 192)], 576
    ranks = [16] * 8
    ranges = [(i % 8, 2 * i, 2) for i in range(32)]
    wide = torch.randn(64, 2 * in_features)
    x = wide[:, :in_features]  # row stride 2K
    y0 = torch.randn(64, 960)
    torch.set_num_threads(2)
    want = _apply("torch", ranks, slices, in_features, ranges, x, y0)
    got = _apply("cpu", ranks, slices, in_features, ranges, x, y0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_runner_picks_the_kernel_on_the_cpu(monkeypatch):
    from engine.lora.manager import lora_kernel

    monkeypatch.delenv("TESSERA_LORA_KERNEL", raising=False)
    assert lora_kernel(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "torch")
    assert lora_kernel(torch.device("cpu")) == "torch"


def test_the_kernel_takes_every_rank_the_engine_allows():
    from engine.config import MAX_LORA_RANK_LIMIT

    assert cpu_lora.MAX_RANK >= MAX_LORA_RANK_LIMIT


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_a_swap_leaves_nothing_of_the_slots_last_adapter(kernel):
    """set_slot zeroes only what the previous adapter wrote: a rank-4 adapter on one slice
    after a rank-16 one on three holds exactly what a fresh slot would."""
    slices, cpu = [(0, 48), (48, 16), (64, 16)], torch.device("cpu")
    g = torch.Generator().manual_seed(3)

    def parts(r, which):
        return [
            (torch.randn(r, 64, generator=g), torch.randn(size, r, generator=g))
            if i in which
            else None
            for i, (_, size) in enumerate(slices)
        ]

    small = parts(4, {2})
    used = LoRALayer(LoRABatch(cpu, kernel), slices, 64, 2, 16, torch.float32, cpu)
    used.set_slot(1, parts(16, {0, 1, 2}))
    used.set_slot(1, small)
    fresh = LoRALayer(LoRABatch(cpu, kernel), slices, 64, 2, 16, torch.float32, cpu)
    fresh.set_slot(1, small)
    assert torch.equal(used.a, fresh.a) and torch.equal(used.b, fresh.b)
    assert used.parts == fresh.parts and used.width == fresh.width
    used.set_slot(1, None)
    assert not used.a.any() and not used.b.any() and used.width[1] == 0


def _bf16_layer(batch, ranks, slices, in_features, dtype):
    """_layer's adapters rounded to bf16, in slots of `dtype` (the same values either way)."""
    layer = _layer(batch, ranks, slices, in_features, seed=1)
    if dtype == torch.float32:
        layer.a.copy_(layer.a.bfloat16().float())
        layer.b.copy_(layer.b.bfloat16().float())
        return layer
    twin = LoRALayer(batch, slices, in_features, len(ranks), max(ranks), dtype, torch.device("cpu"))
    twin.a.copy_(layer.a)
    twin.bt.copy_(layer.bt)
    twin.width, twin.parts = layer.width, layer.parts
    twin.width_t.copy_(layer.width_t)
    twin.slice_off.copy_(layer.slice_off)
    twin.slice_rank.copy_(layer.slice_rank)
    return twin


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("ranks", "slices", "in_features"), CASES + [([16] * 3, [(0, 96)], 200)])
def test_bf16_slots_match_float32_sums_of_the_same_values(portable, ranks, slices, in_features):
    """bf16 slots (a bf16 model's, lora_apply_bf16w: AVX512-BF16 where built, and the portable
    kernel) against the torch path in float32 on the same bf16 values, rounded once: at most
    one bf16 step apart (relative 2**-7; the sums' order differs), base rows untouched."""
    torch.manual_seed(2)
    out, num_rows = sum(s for _, s in slices), 45
    x = torch.randn(num_rows, in_features).bfloat16()
    y0 = torch.randn(num_rows, out).bfloat16()
    ref_batch = LoRABatch(torch.device("cpu"), "torch")
    ref_batch.set(RANGES)
    ref = _bf16_layer(ref_batch, ranks, slices, in_features, torch.float32)
    want = ref.apply(x.float(), y0.float()).bfloat16().float()
    batch = LoRABatch(torch.device("cpu"), "cpu")
    batch.set(RANGES)
    layer = _bf16_layer(batch, ranks, slices, in_features, torch.bfloat16)
    assert cpu_lora.supports(x, y0, layer.bt)
    got = y0.clone()
    cpu_lora.lora_apply(
        x, got, layer.a, layer.bt, layer.width_t, layer.slice_row, layer.slice_size,
        layer.slice_off, layer.slice_rank, batch.token_rows, batch.seg_start, batch.seg_len,
        batch.seg_slot, variant="portable" if portable else "vector",
    )  # fmt: skip
    torch.testing.assert_close(got.float(), want, atol=1e-6, rtol=2**-7)
    assert (got.float() != want).float().mean() < 0.05, "more than a few sums rounded apart"
    assert not torch.equal(got, y0), "no delta applied"
    base_rows = [21, 22, 23, *range(32, 40)]
    assert torch.equal(got[base_rows], y0[base_rows]), "rows of the base model changed"


def test_bf16_slots_split_over_threads_match_the_portable_kernel():
    """Enough work to fork: eight adapters over 64 rows (SmolLM2's qkv), a strided x; the
    AVX512-BF16 kernel against the portable one on the same bf16 slots."""
    torch.manual_seed(3)
    slices, in_features = [(0, 576), (576, 192), (768, 192)], 576
    ranges = [(i % 8, 2 * i, 2) for i in range(32)]
    x = torch.randn(64, 2 * in_features).bfloat16()[:, :in_features]
    y0 = torch.randn(64, 960).bfloat16()
    batch = LoRABatch(torch.device("cpu"), "cpu")
    batch.set(ranges)
    layer = _bf16_layer(batch, [16] * 8, slices, in_features, torch.bfloat16)
    torch.set_num_threads(2)
    outs = []
    for portable in (False, True):
        y = y0.clone()
        cpu_lora.lora_apply(
            x, y, layer.a, layer.bt, layer.width_t, layer.slice_row, layer.slice_size,
            layer.slice_off, layer.slice_rank, batch.token_rows, batch.seg_start, batch.seg_len,
            batch.seg_slot, variant="portable" if portable else "vector",
        )  # fmt: skip
        outs.append(y.float())
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=2**-7)
    assert not torch.equal(outs[0], y0.float())


def test_a_bf16_model_gets_bf16_slots_and_a_float32_model_float32():
    assert cpu_lora.slot_dtype(torch.bfloat16) == torch.bfloat16
    assert cpu_lora.slot_dtype(torch.float32) == torch.float32
    assert cpu_lora.slot_dtype(torch.float16) == torch.float32


AMX_CASES = [
    # (ranks per slot, slices, in_features, max rank), each K a multiple of 32
    ([8, 16, 64], [(0, 48), (48, 16), (64, 16)], 64, 64),  # rank 64: two rank chunks
    ([16] * 8, [(0, 576), (576, 192), (768, 192)], 576, 16),  # SmolLM2's qkv, 8 adapters
    ([7, 0, 5], [(0, 50), (50, 33)], 96, 7),  # odd ranks: A's rows end mid-tile, odd columns
    ([16, 8, 16], [(0, 1536), (1536, 1536)], 576, 16),  # gate_up: 48 blocks of 64 columns
]
AMX_RANGES = RANGES + [(0, 45, 20), (1, 65, 16)]  # a segment of 28 rows: two row tiles
# (every case has three slots: RANGES's)


@pytest.mark.skipif(
    not cpu_lora.amx_takes(torch.bfloat16, 64), reason="no AMX-bf16 tiles on this CPU"
)
@pytest.mark.parametrize(("ranks", "slices", "in_features", "max_rank"), AMX_CASES)
def test_amx_tiles_match_the_reference_with_the_shrink_in_bf16(
    ranks, slices, in_features, max_rank
):
    """lora_amx.c against torch in float32 with s = A x rounded to bf16 (as peft computes
    lora_A(x) in a bf16 model, and as the tiles' B operand takes it), y rounded once: equal
    but for a few values a bf16 step apart, base rows untouched; x strided, on two threads."""
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(5)
    out, num_rows = sum(s for _, s in slices), 81
    batch = LoRABatch(torch.device("cpu"), "cpu")
    batch.set(AMX_RANGES)
    layer = LoRALayer(
        batch, slices, in_features, len(ranks), max_rank, torch.bfloat16, torch.device("cpu")
    )
    parts = {}
    for slot, r in enumerate(ranks):
        if r == 0:
            layer.set_slot(slot, None)
            continue
        pairs = [
            (torch.randn(r, in_features, generator=g) / in_features**0.5, torch.randn(n, r, generator=g))
            for _, n in slices
        ]  # fmt: skip
        layer.set_slot(slot, pairs)
        parts[slot] = pairs
    x = torch.randn(num_rows, 2 * in_features).bfloat16()[:, :in_features]
    y0 = torch.randn(num_rows, out).bfloat16()
    want = y0.float()
    for slot, first, n in AMX_RANGES:
        if slot not in parts:
            continue
        for c, (row0, size) in enumerate(slices):
            r = parts[slot][c][0].shape[0]
            a = layer.a[slot, layer.slice_off[slot, c] : layer.slice_off[slot, c] + r].float()
            s = (x[first : first + n].float() @ a.T).bfloat16().float()
            want[first : first + n, row0 : row0 + size] += (
                s @ layer.bt[slot, :r, row0 : row0 + size].float()
            )
    want = want.bfloat16()
    torch.set_num_threads(2)
    got = y0.clone()
    taken = cpu_lora.lora_apply(
        x, got, layer.a, layer.bt, layer.width_t, layer.slice_row, layer.slice_size,
        layer.slice_off, layer.slice_rank, batch.token_rows, batch.seg_start, batch.seg_len,
        batch.seg_slot, variant="amx",
    )  # fmt: skip
    assert taken
    # s's float32 sums come in another order than torch's: a sum by a rounding boundary may
    # round the other way, and y then one bf16 step off (a handful of values, never more)
    torch.testing.assert_close(got.float(), want.float(), atol=2**-6, rtol=2**-7)
    assert (got != want).float().mean() < 1e-3, "more than a few sums rounded apart"
    base_rows = [21, 22, 23, *range(32, 40), *range(81 - 0, num_rows)]
    assert torch.equal(got[base_rows], y0[base_rows]), "rows of the base model changed"


@pytest.mark.skipif(
    not cpu_lora.amx_takes(torch.bfloat16, 64), reason="no AMX-bf16 tiles on this CPU"
)
def test_amx_tiles_decline_k_not_a_multiple_of_32_and_auto_runs_the_vector_kernel():
    batch = LoRABatch(torch.device("cpu"), "cpu")
    batch.set(RANGES)
    layer = _bf16_layer(batch, [8, 16, 8], [(0, 40)], 72, torch.bfloat16)
    x, y0 = torch.randn(45, 72).bfloat16(), torch.randn(45, 40).bfloat16()
    args = (
        layer.a, layer.bt, layer.width_t, layer.slice_row, layer.slice_size, layer.slice_off,
        layer.slice_rank, batch.token_rows, batch.seg_start, batch.seg_len, batch.seg_slot,
    )  # fmt: skip
    y = y0.clone()
    assert cpu_lora.lora_apply(x, y, *args, variant="amx") is False
    assert torch.equal(y, y0), "a declined call wrote"
    assert not cpu_lora.amx_takes(torch.bfloat16, 72)
    vector = y0.clone()
    cpu_lora.lora_apply(x, vector, *args, variant="vector")
    assert cpu_lora.lora_apply(x, y, *args) is True
    assert torch.equal(y, vector) and not torch.equal(y, y0)
