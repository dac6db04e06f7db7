"""The fused ops' one dispatch rule (engine.layers.ops): a layer built on its own runs the torch
reference; bind_custom_ops chooses the device's kernels once, honouring TESSERA_CPU_KERNELS /
TESSERA_GPU_FUSED as they are at that moment, and no call asks again; every bound form
computes what the reference computes."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu import build
from engine.kernels.cpu import fused_ops as cpu_fused
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.ops import CustomOp, bind_custom_ops, dispatch_for
from engine.layers.rotary import ApplyRotary, RotaryEmbedding

ROOT = Path(__file__).resolve().parents[3]

needs_kernels = pytest.mark.skipif(
    not cpu_fused.available(), reason="no C compiler for the CPU kernels"
)


def _ops() -> torch.nn.ModuleList:
    return torch.nn.ModuleList([RMSNorm(64), SiluAndMul(), ApplyRotary()])


def _count(monkeypatch, name: str) -> list[int]:
    """Count the calls of cpu_fused.<name> from now on."""
    calls = [0]
    real = getattr(cpu_fused, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_fused, name, counted)
    return calls


def _norm_inputs(dtype=torch.bfloat16, rows=5):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 64, generator=g) * 3).to(dtype)
    res = torch.randn(rows, 64, generator=g).to(dtype)
    return x, res


def test_an_unbound_layer_runs_the_reference(monkeypatch):
    """Built on its own (a unit test's layer, before any load), forward is forward_native:
    no kernel is called."""
    for name in ("rms_norm", "silu_and_mul", "rope"):
        monkeypatch.setattr(cpu_fused, name, lambda *a, **k: pytest.fail("a kernel ran"))
    norm, act, rotary = _ops()
    assert {op.dispatch for op in (norm, act, rotary)} == {"native"}
    x, res = _norm_inputs()
    assert torch.equal(norm(x), norm.forward_native(x))
    assert torch.equal(act(x), act.forward_native(x))
    cos, sin = RotaryEmbedding(16, 32, 10000.0).lookup(torch.arange(5), x.dtype)
    qk = x.view(5, 4, 16)
    assert torch.equal(rotary(qk, cos, sin), RotaryEmbedding.apply_torch(qk, cos, sin))


@needs_kernels
def test_a_bound_cpu_norm_calls_the_kernel_and_equals_the_reference(monkeypatch):
    calls = _count(monkeypatch, "rms_norm")
    norm = RMSNorm(64).to(torch.bfloat16)
    assert bind_custom_ops(norm, "cpu") == "cpu" and norm.dispatch == "cpu"
    x, res = _norm_inputs()
    got = norm(x)
    assert calls[0] == 1
    torch.testing.assert_close(got, norm.forward_native(x), rtol=1.6e-2, atol=1e-2)
    got, got_res = norm(x, res.clone())
    want, want_res = norm.forward_native(x, res.clone())
    assert calls[0] == 2
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


@needs_kernels
def test_the_switch_is_read_at_bind_and_never_per_call(monkeypatch):
    """TESSERA_CPU_KERNELS=0 before bind: the reference. Set after bind, it changes nothing,
    and the kernels' availability is not asked again on any call."""
    monkeypatch.setenv("TESSERA_CPU_KERNELS", "0")
    off = _ops()
    assert bind_custom_ops(off, "cpu") == "native"
    assert {op.dispatch for op in off} == {"native"}
    calls = _count(monkeypatch, "rms_norm")
    x, _ = _norm_inputs()
    off[0].to(torch.bfloat16)(x)
    assert calls[0] == 0

    monkeypatch.delenv("TESSERA_CPU_KERNELS")
    on = _ops()
    assert bind_custom_ops(on, "cpu") == "cpu"
    monkeypatch.setenv("TESSERA_CPU_KERNELS", "0")  # too late: the choice was made
    for probe in (cpu_fused.available, cpu_fused.supports, build.kernels_enabled):
        monkeypatch.setattr(probe.__module__ + "." + probe.__name__, _no_probe)
    norm = on[0].to(torch.bfloat16)
    for _ in range(3):
        norm(x)
        on[1](x)
    assert calls[0] == 3 and {op.dispatch for op in on} == {"cpu"}


def _no_probe(*args, **kwargs):
    pytest.fail("a kernel's availability was asked per call")


@needs_kernels
def test_a_bound_op_takes_the_reference_for_tensors_the_kernel_cannot_take(monkeypatch):
    """The checks that stay per call are about the tensors: another dtype than the weight's,
    a residual without unit last stride, a 3-D input."""
    calls = _count(monkeypatch, "rms_norm")
    norm = RMSNorm(64).to(torch.bfloat16)
    norm.bind("cpu")
    x, res = _norm_inputs()
    assert torch.equal(norm(x.float()), norm.forward_native(x.float()))
    got_res, want_res = res.t().contiguous().t(), res.t().contiguous().t()  # columns apart
    assert got_res.stride(-1) != 1
    got, want = norm(x, got_res), norm.forward_native(x, want_res)
    assert torch.equal(got[0], want[0]) and torch.equal(got_res, want_res)
    assert torch.equal(norm(x.view(1, 5, 64)), norm.forward_native(x.view(1, 5, 64)))
    assert calls[0] == 0
    norm(x)
    assert calls[0] == 1


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bound_silu_and_rotary_equal_the_reference(dtype, monkeypatch):
    silu_calls, rope_calls = _count(monkeypatch, "silu_and_mul"), _count(monkeypatch, "rope")
    _, act, rotary = ops = _ops()
    bind_custom_ops(ops, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 200, generator=g) * 4).to(dtype)
    if dtype == torch.bfloat16:  # exp's last bits may move a silu by a step
        torch.testing.assert_close(act(x), act.forward_native(x), rtol=2**-6, atol=1e-2)
    else:
        torch.testing.assert_close(act(x), act.forward_native(x), rtol=1e-6, atol=1e-6)
    qkv = torch.randn(7, 10, 32, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(32, 64, 10000.0).lookup(torch.randperm(64, generator=g)[:7], dtype)
    qk = qkv[:, :8]  # a view of a fused QKV output
    exact = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(rotary(qk, cos, sin), rotary.forward_native(qk, cos, sin), **exact)
    assert silu_calls[0] == 1 and rope_calls[0] == 1


@needs_kernels
def test_a_copy_of_a_bound_op_runs_its_own_forward():
    """bind sets the instance's forward (a bound method): a copy's is the copy's."""
    norm = RMSNorm(64)
    norm.bind("cpu")
    twin = copy.deepcopy(norm)
    twin.weight.data.fill_(2.0)
    assert twin.dispatch == "cpu" and twin.forward.__self__ is twin
    x, _ = _norm_inputs(torch.float32)
    torch.testing.assert_close(twin(x), 2 * norm(x))


def test_other_devices_and_switched_off_cuda_bind_the_reference(monkeypatch):
    assert dispatch_for("meta") == "native"
    monkeypatch.setenv("TESSERA_GPU_FUSED", "0")
    assert dispatch_for("cuda") == "native"
    op = SiluAndMul()
    with pytest.raises(ValueError, match="native, cpu or cuda"):
        op.bind("mps")
    assert op.dispatch == "native"


def test_a_loaded_model_has_its_ops_bound(tiny_llama_dir):
    """The loader binds the model's ops to its device's kernels once, after its weights."""
    from engine.models.loader import load_model

    model = load_model(tiny_llama_dir, dtype="float32", device="cpu")
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert {type(m) for m in ops} == {RMSNorm, SiluAndMul, ApplyRotary}
    want = "cpu" if cpu_fused.available() else "native"
    assert {m.dispatch for m in ops} == {want}


def test_the_cpu_path_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from engine.layers.norm import RMSNorm\n"
        "from engine.layers.ops import bind_custom_ops\n"
        "norm = RMSNorm(8)\n"
        "bind_custom_ops(norm, 'cpu')\n"
        "norm(torch.randn(2, 8))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
