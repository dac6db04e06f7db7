"""The layers' fused Triton kernels (engine/kernels/triton/fused_ops.py: RMSNorm with its
residual add, rotary embedding, SiLU-and-mul) against the torch path they replace on CUDA.

Without a GPU they run under Triton's interpreter on CPU tensors (tests/engine/conftest.py),
whose fp32 -> bf16 cast truncates: bf16 results are then within a bf16 step of the torch
path's. On a GPU they run compiled on CUDA tensors, and the `cuda` tests check that the
layers pick them and that a model's greedy tokens are the torch ops'.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.triton import fused_ops  # noqa: E402
from engine.layers.norm import RMSNorm  # noqa: E402
from engine.layers.ops import CustomOp, bind_custom_ops  # noqa: E402
from engine.layers.rotary import RotaryEmbedding  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _torch_norm(norm: RMSNorm, x, residual=None):
    return norm.forward_native(x, residual)  # the torch ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 72), (33, 576)])  # 72, 576: no power of 2
def test_rms_norm_with_and_without_residual(dtype, rows, hidden):
    """norm(x) and, with a residual, the residual updated in place and its norm; x a strided
    view (rows further apart than the hidden size)."""
    g = torch.Generator().manual_seed(rows)
    wide = (torch.randn(rows, hidden + 8, generator=g) * 3).to(dtype).to(DEVICE)
    x = wide[:, :hidden]
    norm = RMSNorm(hidden, eps=1e-5).to(dtype).to(DEVICE)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    res = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)

    got = fused_ops.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(got, _torch_norm(norm, x), **TOL[dtype])

    got_res = res.clone()
    got = fused_ops.rms_norm(x, norm.weight, norm.eps, got_res)
    want, want_res = _torch_norm(norm, x, res.clone())
    if dtype == torch.bfloat16 and not HAS_CUDA:  # the interpreter truncates the sum
        torch.testing.assert_close(got_res, want_res, **TOL[dtype])
    else:
        assert torch.equal(got_res, want_res)  # one rounding of the same sum
    assert not torch.equal(got_res, res)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (5, 48), (12, 128)])
def test_rope_matches_the_torch_rotation(dtype, heads, head_dim):
    """q and k rotated together from a view of a fused QKV output (token stride > heads x D),
    positions out of order, against RotaryEmbedding.apply_torch."""
    g = torch.Generator().manual_seed(heads)
    t = 9
    rotary = RotaryEmbedding(head_dim, 256, 10000.0).to(DEVICE)
    positions = torch.randperm(200, generator=g)[:t].to(DEVICE)
    cos, sin = rotary.lookup(positions, dtype)
    qkv = torch.randn(t, heads + 2, head_dim, generator=g).to(dtype).to(DEVICE)
    x = qkv[:, :heads]
    got = fused_ops.rope(x, cos, sin)
    assert got.is_contiguous() and got.shape == x.shape
    torch.testing.assert_close(got, RotaryEmbedding.apply_torch(x, cos, sin), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 96), (6, 1500)])  # 1500: over one 1024 block
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(fused_ops.silu_and_mul(x), want, **TOL[dtype])


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert fused_ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert fused_ops.silu_and_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
    cos = torch.empty(0, 1, 8, device=DEVICE)
    assert fused_ops.rope(torch.empty(0, 2, 16, device=DEVICE), cos, cos).shape == (0, 2, 16)


def test_off_the_gpu_the_layers_keep_their_paths():
    """A CPU model's ops are never bound to the Triton kernels (the CPU has its C kernels or
    torch); tensors the kernels cannot take are refused by fits / rope_fits."""
    x = torch.randn(4, 64)
    norm = RMSNorm(64)
    assert bind_custom_ops(norm, "cpu") != "cuda" and norm.dispatch != "cuda"
    assert not fused_ops.fits(x.to(torch.int32)) and not fused_ops.fits(x.t())
    cos = x[:, :16].contiguous().view(4, 1, 16)
    assert fused_ops.rope_fits(x.view(4, 2, 32), cos, cos)
    assert not fused_ops.rope_fits(x.view(4, 2, 32), cos, x[:, :16])  # sin not contiguous


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_cuda_forms_call_them_and_keep_the_reference_values(dtype, monkeypatch):
    """The layers' forward_cuda (bound by hand here: off a GPU, on the interpreter's CPU
    tensors) gives the torch path's values, and takes the torch path for what the kernels
    cannot take (a 3-D norm input, a rotary sin that is not contiguous)."""
    from engine.layers.activation import SiluAndMul
    from engine.layers.rotary import ApplyRotary

    calls = {name: 0 for name in ("rms_norm", "silu_and_mul", "rope")}
    for name in calls:
        real = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *a, _n=name, _f=real: _count(calls, _n, _f, a))
    g = torch.Generator().manual_seed(5)
    norm, act, rotary = RMSNorm(64).to(dtype).to(DEVICE), SiluAndMul(), ApplyRotary()
    for op in (norm, act, rotary):
        op.bind("cuda")
    x = torch.randn(6, 64, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(6, 64, generator=g).to(dtype).to(DEVICE)
    torch.testing.assert_close(norm(x), norm.forward_native(x), **TOL[dtype])
    got, got_res = norm(x, res.clone())
    want, want_res = norm.forward_native(x, res.clone())
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_res, want_res, **TOL[dtype])
    assert torch.equal(norm(x.view(2, 3, 64)), norm.forward_native(x.view(2, 3, 64)))
    torch.testing.assert_close(act(x), act.forward_native(x), **TOL[dtype])
    cos, sin = (
        RotaryEmbedding(32, 64, 10000.0).to(DEVICE).lookup(torch.arange(6, device=DEVICE), dtype)
    )
    qk = x.view(6, 2, 32)
    torch.testing.assert_close(
        rotary(qk, cos, sin), rotary.forward_native(qk, cos, sin), **TOL[dtype]
    )
    odd = torch.cat((sin, sin), -1)[..., :16]  # [6, 1, 16], rows 32 apart: not contiguous
    assert torch.equal(rotary(qk, cos, odd), rotary.forward_native(qk, cos, odd))
    assert calls == {"rms_norm": 2, "silu_and_mul": 1, "rope": 1}


def _count(calls: dict, name: str, kernel, args):
    calls[name] += 1
    return kernel(*args)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_model_on_cuda_takes_them_and_keeps_its_tokens(tiny_llama_dir, monkeypatch):
    """The engine on CUDA: the fused ops (norms, rotary, SiLU-and-mul) are bound to the
    kernels at load, and float32 greedy tokens equal those of the torch ops (the kernels
    switched off by TESSERA_GPU_FUSED=0 before the load)."""
    from engine import LLM, SamplingParams

    prompts = [list(range(5 + 3 * i, 30 + 5 * i)) for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setenv("TESSERA_GPU_FUSED", "0")  # read when the model's ops are bound
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        model = llm.engine.executor.runner.model
        ops = [m for m in model.modules() if isinstance(m, CustomOp)]  # norms, rotary, SiLU
        assert len({type(m) for m in ops}) == 3
        assert all((m.dispatch == "cuda") == fused for m in ops)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        llm.shutdown()
    assert tokens[0] == tokens[1]
