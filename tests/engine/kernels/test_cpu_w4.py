"""4-bit weight groups (engine.kernels.cpu.w4): the format, the kernel against F.linear on the
dequantized weight, the layers' routing by batch size, and the engine with w4a8."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.quantization.quantize import quantize_layer
from engine.layers.quantization.w8a8 import AMX_W8A8_MIN_ROWS, W8A8_MIN_ROWS, W8A8LMHeadMethod
from tests.engine.kernels.w4_testing import (
    avx2_variant,
    x_as_the_kernel_reads_it,
    x_int8_per_group,
)


def _require_kernel():
    if not cpu_w4.available():
        pytest.skip("the 4-bit kernel needs a C compiler and AVX512-VNNI or AVX2")


def test_groups_round_trip():
    torch.manual_seed(0)
    w = torch.randn(20, 128) * torch.logspace(-3, 0, 20)[:, None]
    w[3, :32] = 0.25  # a constant group: scale 0, every code 0, exact
    w[4, 40] = 5.0  # an outlier widens its own group only
    q4 = cpu_w4.quantize_groups(w)
    # two tiles of 16 rows (the second padded), 4 groups of 32: 256 bytes of codes, 16 scales,
    # 16 minimums
    assert q4.data.dtype == torch.uint8 and q4.data.shape == (2, 4 * 320)
    assert (q4.out_features, q4.in_features) == (20, 128)
    back = cpu_w4.dequantize(q4)
    assert back.shape == w.shape
    g = w.view(20, 4, 32)
    step = (g.amax(-1) - g.amin(-1)) / 15  # per group
    err = (back - w).view(20, 4, 32).abs().amax(-1)
    assert (err <= step / 2 + 2e-3 * g.abs().amax(-1)).all()  # half a step (+ float16 scales)
    assert torch.equal(back[3, :32], w[3, :32])
    assert err[4, 0] < 1e-3 and err[4, 1] > 1e-3  # the outlier's group pays, its neighbour not
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_w4.quantize_groups(torch.randn(4, 96))


@pytest.mark.parametrize(
    "m, n, k",
    [
        (1, 70, 576),
        (2, 130, 1536),
        (1, 3, 64),
        (2, 65, 1088),
        (5, 48, 128),
        (8, 33, 576),
        (12, 40, 576),
        (13, 17, 192),  # from here: the AVX2 kernel only (every remainder of its 4-row passes)
        (16, 33, 576),  # from 16 rows: tiles unpacked once, passes of 6 rows
        (70, 50, 128),
        (129, 40, 1536),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_f_linear_on_the_dequantized_weight(m, n, k, bias):
    """Up to the bf16 output's rounding and x's quantization: int16 per row (VNNI; within the
    tolerance), or int8 per group of 32 (AVX2: the reference rounds x the same way)."""
    _require_kernel()
    if m > cpu_w4.max_rows():
        pytest.skip(f"the kernel takes {cpu_w4.max_rows()} rows")
    torch.manual_seed(m * 1000 + n + k)
    q4 = cpu_w4.quantize_groups(torch.randn(n, k) * 0.05)
    x = torch.randn(m, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    y = cpu_w4.linear(x, q4, b)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = torch.nn.functional.linear(
        x_as_the_kernel_reads_it(x),
        cpu_w4.dequantize(q4).double(),
        None if b is None else b.double(),
    )
    torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
    if avx2_variant():  # x rounded alike: only the float sums' order and the bf16 output
        torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3 * ref.abs().max().item())
    # 3-D input, and the calls the kernel does not take
    assert torch.equal(cpu_w4.linear(x.view(m, 1, k), q4, b).view(m, n), y)
    if not avx2_variant():
        too_many = torch.randn(cpu_w4.max_rows() + 1, k).to(torch.bfloat16)
        assert cpu_w4.linear(too_many, q4) is None
    assert cpu_w4.linear(x.float(), q4) is None  # float32
    if k != 64:
        assert cpu_w4.linear(x[:, :64], q4) is None  # another K


@pytest.mark.parametrize(
    "m, n, k",
    [(1, 70, 576), (7, 33, 128), (8, 16, 64), (13, 17, 192), (32, 130, 1536), (129, 40, 576)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_batch_kernel_matches_f_linear_on_the_dequantized_weight(m, n, k, bias):
    """The AVX512-VNNI batch kernel (any rows, every remainder of its 8-row passes, a tile's
    unused rows): x rounded to int8 per group of 32 in the reference too, so only the float
    sums' order and the bf16 output differ."""
    if not cpu_w4.batch_available():
        pytest.skip("the batch kernel is in AVX512-VNNI builds")
    torch.manual_seed(m * 1000 + n + k)
    q4 = cpu_w4.quantize_groups(torch.randn(n, k) * 0.05)
    x = torch.randn(m, k).to(torch.bfloat16)
    x[0, :32] = 0  # a group of zeros: scale 0
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    y = cpu_w4.linear_batch(x, q4, b)
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (m, n)
    w = cpu_w4.dequantize(q4).double()
    ref = torch.nn.functional.linear(x_int8_per_group(x), w, None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-3 * ref.abs().max().item())
    strided = torch.randn(m, 2 * k).to(torch.bfloat16)[:, :k]  # rows apart: ldx != K
    strided.copy_(x)
    assert torch.equal(cpu_w4.linear_batch(strided, q4, b), y)
    assert cpu_w4.linear_batch(x.float(), q4) is None  # bf16 x only
    if k != 64:
        assert cpu_w4.linear_batch(x[:, :64], q4) is None  # another K


def _q8_0_rows(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Q8_0 rows (ggml's block_q8_0: float16 d, 32 int8 codes) and their float values."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half()
    q = torch.randint(-128, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    q[0, 0, :2] = torch.tensor([-128, 127], dtype=torch.int8)  # both ends of the codes
    rows = torch.cat([d.view(torch.uint8).view(n, k // 32, 2), q.view(torch.uint8)], dim=2)
    return rows.reshape(n, -1).contiguous(), (d.float()[..., None] * q.float()).reshape(n, k)


@pytest.mark.parametrize(
    "m, n, k",
    [(1, 70, 576), (2, 16, 64), (3, 33, 128), (9, 48, 192), (17, 200, 576), (70, 40, 128)],
)
def test_q8_tiles_stand_for_the_q8_0_rows(m, n, k):
    """Q8_0 rows as tiles in this build's layout (two nibble planes of w4 tiles with AVX2, one
    plane for vpdpbusd with AVX512-VNNI: the LM head's): the file's values exactly, float32
    out, x rounded as the dot kernel rounds it (so its logits to float rounding)."""
    from engine.kernels.cpu import gguf as cpu_gguf

    if not cpu_w4.q8_available():
        pytest.skip("the Q8 tile kernels need AVX2 or AVX512-VNNI")
    rows, w = _q8_0_rows(n, k, seed=m * 1000 + n + k)
    tiles = cpu_w4.pack_q8_0(rows, k)
    groups = k // 32
    assert tiles.data.shape == ((n + 15) // 16, groups * cpu_w4.Q8_GROUP_BYTES)
    x = torch.randn(m, k).to(torch.bfloat16)
    y = cpu_w4.linear_q8(x, tiles)
    assert y is not None and y.dtype == torch.float32 and y.shape == (m, n)
    ref = x_int8_per_group(x) @ w.double().T  # both Q8 kernels round x so
    torch.testing.assert_close(y.double(), ref, rtol=1e-3, atol=2e-3 * ref.abs().max().item())
    if m <= cpu_gguf.dot_max_rows():  # above them cpu_gguf dequantizes for a GEMM
        dot = cpu_gguf.linear(x.float(), rows, 8, k)  # ggml's Q8_0 is type 8
        torch.testing.assert_close(y, dot, rtol=1e-5, atol=1e-5 * dot.abs().max().item())
    assert tiles.layout == cpu_w4.q8_layout()
    other = "planes" if tiles.layout == "vnni" else "vnni"
    packed = cpu_w4.pack_q8_0(rows, k, other)  # the other layout: as large, arranged otherwise
    assert packed.data.shape == tiles.data.shape and not torch.equal(packed.data, tiles.data)
    assert cpu_w4.linear_q8(x, packed) is None  # its kernel is not in this build
    assert cpu_w4.linear_q8(x.float(), tiles) is None  # bf16 x only
    assert cpu_w4.linear_q8(x[:, :32], tiles) is None  # another K
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_w4.pack_q8_0(rows[:, : 3 * 34].contiguous(), 96)
    huge = rows.clone()
    huge[0, :2] = torch.tensor([0.0], dtype=torch.float16).fill_(1024).view(torch.uint8)
    with pytest.raises(ValueError, match="overflows"):  # -128 * 1024 is past float16's range
        cpu_w4.pack_q8_0(huge, k)


@pytest.mark.parametrize("m", [1, 5, 8, 9, 130])
def test_q8_argmax_epilogue_is_the_logits_argmax(m):
    """The VNNI Q8 tiles' argmax: the argmax of linear_q8's float32 logits, the first maximum
    winning, ties placed in one tile, across tiles and across the threads' column runs."""
    if cpu_w4.q8_layout() != "vnni":
        pytest.skip("the argmax epilogue is the AVX512-VNNI tiles' (AVX2: the logits)")
    n, k = 1000, 128  # 63 tiles, the last one partial
    rows, _ = _q8_0_rows(n, k, seed=m)
    for a, b in ((3, 900), (20, 21), (400, 401), (998, 999)):
        rows[b] = rows[a]  # equal rows give equal logits: the lower index must win
    tiles = cpu_w4.pack_q8_0(rows, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            logits = cpu_w4.linear_q8(x, tiles)
            tokens = cpu_w4.argmax_q8(x, tiles)
            assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(-1))
            # each tied pair made every row's winner: the first of the pair must be chosen
            for a, b in ((3, 900), (20, 21), (400, 401), (998, 999)):
                boost = rows.clone()
                boost[[a, b], :2] = torch.tensor([64.0], dtype=torch.float16).view(torch.uint8)
                xb = x.clone()  # first group's x along the pair's codes: a large positive dot
                xb[:, :32] = rows[a, 2:34].view(torch.int8).float().sign().to(torch.bfloat16)
                bt = cpu_w4.pack_q8_0(boost, k)
                assert (cpu_w4.linear_q8(xb, bt).argmax(-1) == a).all()
                assert (cpu_w4.argmax_q8(xb, bt) == a).all()
    finally:
        torch.set_num_threads(threads)
    assert cpu_w4.argmax_q8(x.float(), tiles) is None  # bf16 x only
    assert cpu_w4.argmax_q8(x[:, :64], tiles) is None  # another K


def test_layers_read_4_bits_below_their_int8_activation_rows_only(tiles):
    """A w4a8 layer reads its 4-bit copy for fewer rows than its int8-activation threshold
    (13, or 8 where its packed GEMM runs on AMX tiles) and the int8 path from there."""
    _require_kernel()
    from engine.layers.linear import ReplicatedLinear

    torch.manual_seed(2)
    layer = ReplicatedLinear(128, 48, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_()
    layer.to(torch.bfloat16)
    quantize_layer(layer, "w4a8")  # 4-bit groups, int8 rows and their packed copy
    first = layer.quant_method.w8a8_min_rows(layer, 128)
    amx = tiles == "amx"
    assert first == (AMX_W8A8_MIN_ROWS if amx else W8A8_MIN_ROWS)
    assert first - 1 <= cpu_w4.max_rows()
    for rows in (1, 2, first - 1, first, 12, 13):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        if rows < first:
            expected = cpu_w4.linear(x, layer.w4, layer.bias)
        else:
            layer.w4, saved = None, layer.w4  # what the layer does without its 4-bit copy
            expected = layer(x)
            layer.w4 = saved
        assert torch.equal(layer(x), expected), rows


def test_w4a8_engine_generates_and_is_validated(make_tiny_model):
    """A bf16 model with K = 64 and 128: every linear layer gets its 4-bit copy, greedy
    output repeats exactly, and a float32 model is refused with a clear message."""
    _require_kernel()
    from engine import LLM, SamplingParams
    from engine.layers.linear import LinearBase

    path = make_tiny_model("tiny-llama-w4", intermediate_size=128)
    # No prefix cache: a hit leaves fewer prefill rows, which takes w8a8's other path (int8
    # activations from W8A8_MIN_ROWS rows), and this random model's near-ties then flip.
    llm = LLM(
        str(path), dtype="bfloat16", quantization="w4a8", num_kv_blocks=64,
        enable_prefix_caching=False,
    )  # fmt: skip
    model = llm.engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert layers and all(m.w4 is not None and m.weight.dtype == torch.int8 for m in layers)
    # the LM head stays int8: no 4-bit copy
    assert isinstance(model.lm_head.quant_method, W8A8LMHeadMethod)
    assert getattr(model.lm_head, "w4", None) is None
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    prompts = [list(range(5, 5 + n)) for n in (3, 20)]  # decodes of 1-2 rows read 4 bits
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again and all(len(t) == 8 for t in first)
    llm.shutdown()
    with pytest.raises(ValueError, match="w4a8 needs a bfloat16 model"):
        LLM(str(path), dtype="float32", quantization="w4a8", num_kv_blocks=64)
