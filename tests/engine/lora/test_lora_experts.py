"""LoRA on a mixture of experts' projections (engine.lora.experts): adapters written by peft in
both layouts people have — transformers 5's stacked expert parameters (`target_parameters`)
and transformers 4's per-expert modules (Mixtral's w1 / w3 / w2 too) — serve the tokens of
HF + peft (which reads the per-expert layout through its own conversion), in one batch with
other adapters and the base model, with fewer slots than adapters in flight, chunked prefill,
prefix caching and preemption; TP=2 with experts sliced and with whole experts per rank. The
experts' loop with deltas against a per-token reference, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.layers.moe import experts_cpu
from engine.lora.adapter import read_adapter
from engine.lora.experts import ExpertsLoRA
from engine.lora.layers import LoRABatch
from engine.models.hf_config import load_hf_config
from tests.engine.lora.lora_testing import (
    expected_tokens,
    generate_tokens,
    make_adapter,
    make_per_expert_adapter,
)

STACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROMPTS = [list(range(10, 31)), list(range(50, 61)), [5, 9, 13, 17, 21], list(range(100, 133))]


def _adapters(model_dir, root, per_expert: tuple[str, ...] | None = None, shared=False):
    """Three adapters: experts and attention (stacked, or per expert with these module names;
    shared: Qwen2-MoE's shared expert's gate/up/down too, which peft's usual target names
    match), the experts' down_proj alone at another rank, attention alone."""
    if per_expert is None:
        mlp = ["gate_proj", "up_proj", "down_proj"] if shared else []
        first = make_adapter(
            model_dir, root / "experts-qv", r=8, alpha=16, targets=["q_proj", "v_proj", *mlp],
            target_parameters=STACKED, seed=31,
        )  # fmt: skip
    else:
        block = "block_sparse_moe" if per_expert[0] == "w1" else "mlp"
        first = make_per_expert_adapter(
            model_dir, root / "per-expert", r=8, alpha=16, modules=per_expert, block=block,
            seed=31,
        )  # fmt: skip
    return [
        first,
        make_adapter(
            model_dir, root / "down-r4", r=4, alpha=8, targets=["o_proj"],
            target_parameters=["mlp.experts.down_proj"], seed=32,
        ),
        make_adapter(model_dir, root / "attn", r=8, alpha=8, targets=["q_proj", "o_proj"], seed=33),
    ]  # fmt: skip


def _expected(model_dir, adapters, prompts, assign):
    """Each prompt's tokens from HF + peft's (unmerged) model for its adapter."""
    return expected_tokens(model_dir, adapters, prompts, assign, merge=False)


_generate = generate_tokens


CASES = {  # fixture, per-expert module names (None: stacked), the shared expert targeted
    "qwen3_moe-stacked": ("tiny_qwen3_moe_dir", None),
    "qwen3_moe-per-expert": ("tiny_qwen3_moe_dir", ("gate_proj", "up_proj", "down_proj")),
    "mixtral-stacked": ("tiny_mixtral_dir", None),
    "mixtral-per-expert": ("tiny_mixtral_dir", ("w1", "w3", "w2")),
    "qwen2_moe-stacked-shared": ("tiny_qwen2_moe_dir", None, True),
    "gpt_oss-stacked": ("tiny_gpt_oss_dir", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_adapters_serve_peft_tokens_in_a_mixed_batch(case, request, tmp_path):
    """Three adapters and the base in one batch on two slots (swapping), prompts chunked in
    16-token steps; the adapters change the tokens (the experts' deltas matter)."""
    fixture, per_expert, *shared = CASES[case]
    model_dir = request.getfixturevalue(fixture)
    adapters = _adapters(model_dir, tmp_path, per_expert, shared=bool(shared))
    read = read_adapter(adapters[0], load_hf_config(model_dir), 16)
    assert {m for _, m in read.weights} >= {"experts"} | (
        {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"}
        if shared
        else set()
    )
    prompts = PROMPTS + PROMPTS[:2]
    assign = [0, 1, 2, None, 1, 0]
    want = _expected(model_dir, adapters, prompts, assign)
    base = _expected(model_dir, adapters, prompts, [None] * len(prompts))
    assert want[0] != base[0] and want[1] != base[1]  # the expert adapters move greedy tokens
    llm, got = _generate(
        model_dir, adapters, prompts, assign, max_loras=2, max_num_batched_tokens=16
    )
    assert got == want
    assert llm.engine.executor.runner.lora_manager.num_swaps > 2


def test_expert_adapters_with_prefix_caching_and_preemption(tiny_qwen3_moe_dir, tmp_path):
    """Shared prompt heads across adapters (the prefix cache keys blocks by adapter) and a KV
    cache small enough to preempt: each request keeps its adapter's tokens."""
    adapters = _adapters(tiny_qwen3_moe_dir, tmp_path)
    head = list(range(200, 216))  # two blocks; each prompt three, four once it has decoded
    prompts = [head + p[:7] for p in PROMPTS] + [head + [7, 8, 9]]
    assign = [0, 1, 0, None, 1]
    want = _expected(tiny_qwen3_moe_dir, adapters, prompts, assign)
    llm, got = _generate(
        tiny_qwen3_moe_dir, adapters, prompts, assign, max_loras=2, enable_prefix_caching=True,
        num_kv_blocks=12, max_model_len=64, block_size=8,
    )  # fmt: skip
    assert got == want
    assert llm.engine.scheduler.stats().num_preemptions > 0


def test_a_step_with_expert_adapters_stays_out_of_cuda_graphs(tiny_qwen3_moe_dir, tmp_path):
    """The manager names the experts among a step's graph blockers (their rows are grouped on
    the host), which CUDA graphs decline and the CPU decode plan never meets (no MoE plan)."""
    from engine.worker.cpu_graph import DecodePlan
    from engine.worker.cuda_graph import CudaGraphRunner

    adapters = _adapters(tiny_qwen3_moe_dir, tmp_path)
    llm = LLM(str(tiny_qwen3_moe_dir), dtype="float32", device="cpu", enable_lora=True,
              max_loras=2, num_kv_blocks=64)  # fmt: skip
    try:
        manager = llm.engine.executor.runner.lora_manager
        experts, attention = (LoRARequest(f"a{i}", i + 1, str(adapters[i])) for i in (0, 2))
        assert manager.prepare([(attention, 0, 3), (None, 3, 2)])
        assert manager.graph_blockers == set()
        assert manager.prepare([(attention, 0, 3), (experts, 3, 2)])
        assert manager.graph_blockers == {"experts"}
        assert "experts" in CudaGraphRunner.lora_blockers - DecodePlan.lora_blockers
    finally:
        llm.shutdown()


@pytest.mark.cuda
def test_expert_adapters_on_cuda(tiny_qwen3_moe_dir, tiny_gpt_oss_dir, tmp_path):
    """On CUDA a step with expert adapters leaves the fused Triton kernel for the experts'
    loop (torch ops on the device); the other steps keep it."""
    for model_dir in (tiny_qwen3_moe_dir, tiny_gpt_oss_dir):
        adapters = _adapters(model_dir, tmp_path / model_dir.name)
        assign = [0, 1, 2, None]
        want = _expected(model_dir, adapters, PROMPTS, assign)
        _, got = _generate(model_dir, adapters, PROMPTS, assign, max_loras=2, device="cuda")
        assert got == want


@pytest.mark.parametrize("scheme", ["gptq4-g32-sym", "fp8-channel"])
def test_expert_adapters_over_quantized_experts(make_tiny_model, tmp_path, scheme):
    """QLoRA's case on a mixture of experts: every expert quantized (GPTQ 4-bit on the w4
    tiles, compressed-tensors FP8), an adapter on them and on attention; the reference is HF +
    peft over the exact dequantized weights, whose greedy tokens ours follow wherever its
    top-2 gap clears the quantized tests' tolerance (float32)."""
    from peft import PeftModel

    from tests.engine.layers.quantization import quant_writers as qw
    from tests.engine.layers.quantization.test_quant_checkpoints import (
        PROMPTS as QPROMPTS,
    )
    from tests.engine.layers.quantization.test_quant_checkpoints import (
        _assert_greedy_agrees,
        _hf_greedy,
    )
    from tests.engine.layers.quantization.test_quant_moe import (
        MOE_I64,
        SCHEMES,
        WRITERS,
        _gap_tol,
    )

    src = make_tiny_model("tiny-qwen3_moe-i64", arch="qwen3_moe", **MOE_I64["qwen3_moe"])
    if scheme in WRITERS:
        folder, deq = WRITERS[scheme](src, tmp_path / scheme)
    else:
        s = SCHEMES[scheme]
        folder, deq = qw.write_compressed_tensors(
            src, tmp_path / scheme, fmt=s["fmt"], weights=s["weights"],
            input_activations=s.get("input_activations"),
        )  # fmt: skip
    adapter = make_adapter(
        src, tmp_path / "adapter", r=8, alpha=16, targets=["q_proj", "o_proj"],
        target_parameters=STACKED, seed=35,
    )  # fmt: skip
    ref = PeftModel.from_pretrained(qw.reference_model(src, deq), str(adapter)).eval()
    plain = qw.reference_model(src, deq)
    llm = LLM(str(folder), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=256,
              device="cpu", enable_lora=True)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        request = LoRARequest("experts", 1, str(adapter))
        outs = llm.generate(QPROMPTS, params, lora_request=request, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(QPROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        assert theirs != _hf_greedy(plain, prompt)[0]  # the adapter moves the tokens
        _assert_greedy_agrees(out.outputs[0].token_ids, theirs, gaps, _gap_tol(scheme, "float32"))


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
def test_tp2_expert_adapters(tiny_qwen3_moe_dir, tmp_path, expert_parallel):
    """Two gloo ranks: each expert's I split (B13's gate and up rows, A2's columns), or whole
    experts per rank; FusedMoE's all-reduce sums the deltas with the experts' outputs."""
    torch.set_num_threads(1)
    adapters = _adapters(tiny_qwen3_moe_dir, tmp_path)
    adapters[2] = make_per_expert_adapter(tiny_qwen3_moe_dir, tmp_path / "per-expert", seed=34)
    assign = [0, 2, None, 1]
    want = _expected(tiny_qwen3_moe_dir, adapters, PROMPTS, assign)
    _, got = _generate(
        tiny_qwen3_moe_dir, adapters, PROMPTS, assign, max_loras=3, tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    )  # fmt: skip
    assert got == want


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_experts_loop_adds_each_tokens_adapter_delta(kernel):
    """experts_cpu with deltas against a per-token reference: 40 tokens routed top-3 over 6
    experts (one expert gets none), rows of three slots (one without expert weights, one with
    down_proj only) and of the base, interleaved; biases and a gated activation. Both
    kernels: the torch matmuls per expert and adapter, the C kernel per adapter."""
    from engine.kernels.cpu import lora as cpu_lora

    if kernel == "cpu" and not cpu_lora.available():
        pytest.skip("the CPU kernels are not built")
    g = torch.Generator().manual_seed(0)
    t, h, inter, e_count, k, slots = 40, 24, 12, 6, 3, 4
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e_count, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e_count, h, inter, generator=g) / inter**0.5
    b13, b2 = torch.randn(e_count, 2 * inter, generator=g), torch.randn(e_count, h, generator=g)
    logits = torch.randn(t, e_count, generator=g)
    logits[:, 5] = -1e9  # expert 5: no token
    weights, ids = torch.topk(torch.softmax(logits, -1), k)

    def ab(r, i, o):
        return torch.randn(e_count, r, i, generator=g), torch.randn(e_count, o, r, generator=g)

    batch = LoRABatch(torch.device("cpu"), kernel)
    lora = ExpertsLoRA(batch, slots, torch.float32, torch.device("cpu"), e_count)
    adapters = {  # (A [E, r, in], B [E, out, r]) per projection, or None
        0: [ab(8, h, 2 * inter), ab(4, inter, h)],
        1: [None, ab(6, inter, h)],
        3: [ab(2, h, 2 * inter), ab(2, inter, h)],
    }
    for slot, slices in adapters.items():
        lora.set_slot(slot, slices)
    # slot 2 holds an adapter without expert weights: its rows run the base experts
    ranges = [(0, 0, 7), (2, 7, 5), (1, 12, 9), (3, 25, 6), (0, 31, 4)]  # rows 21-24, 35-39: base
    batch.set(ranges)
    assert lora.active
    row_slot = [-1] * t
    for slot, start, n in ranges:
        row_slot[start : start + n] = [slot] * n

    def act(v):
        return torch.nn.functional.silu(v[..., :inter]) * v[..., inter:]

    want = torch.zeros(t, h)
    for i in range(t):
        s = row_slot[i]
        parts = adapters.get(s)
        for j in range(k):
            e = int(ids[i, j])
            pre = w13[e] @ x[i] + b13[e]
            if parts is not None and parts[0] is not None:
                pre = pre + parts[0][1][e] @ (parts[0][0][e] @ x[i])
            hid = act(pre)
            y = w2[e] @ hid + b2[e]
            if parts is not None and parts[1] is not None:
                y = y + parts[1][1][e] @ (parts[1][0][e] @ hid)
            want[i] += weights[i, j] * y
    got = experts_cpu(x, w13, w2, weights, ids, biases=(b13, b2), activation=act, lora=lora)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = experts_cpu(x, w13, w2, weights, ids, biases=(b13, b2), activation=act)
    assert not torch.allclose(got[:7], plain[:7], atol=1e-3)  # slot 0's rows moved
    torch.testing.assert_close(got[7:12], plain[7:12])  # slot 2: no expert weights
    torch.testing.assert_close(got[21:25], plain[21:25])  # the base's rows


@pytest.mark.parametrize("experts", ["float", "int8"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_fused_kernel_adds_the_deltas(activation, experts):
    """The fused Triton MoE (float experts, or the quantized kernel's 8-bit codes) with
    ExpertsLoRA's hooks (the LoRA Triton shrink / expand per adapter over its pairs grouped by
    expert; the first GEMM without its activation) against experts_cpu with the same adapters
    on the torch path over the same weights: 24 tokens top-2 over 8 experts, three adapters
    (one without expert weights, one with down_proj only) and base rows, biases. Without a
    GPU under Triton's interpreter (tests/engine/conftest.py)."""
    pytest.importorskip("triton")
    from engine.kernels.triton import fused_moe
    from engine.layers.activation import SiluAndMul, SwigluOAIAndMul

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(1)
    t, h, inter, e_count, k = 24, 32, 16, 8, 2
    x = torch.randn(t, h, generator=g)

    def codes(n, kk):  # 8-bit codes with a scale per 16 inputs: w = (q - 128) * scale
        q = torch.randint(0, 256, (e_count, n, kk), generator=g, dtype=torch.uint8)
        scales = torch.rand(e_count, n, kk // 16, generator=g) / (8 * kk**0.5)
        w = (q.float() - 128) * scales.repeat_interleave(16, dim=2)
        return w, fused_moe.ExpertWeights(q.to(device), scales.to(device), bits=8, group=16)

    (w13, q13), (w2, q2) = codes(2 * inter, h), codes(h, inter)
    b13, b2 = torch.randn(e_count, 2 * inter, generator=g), torch.randn(e_count, h, generator=g)
    weights, ids = torch.topk(torch.softmax(torch.randn(t, e_count, generator=g), -1), k)

    def ab(r, i, o):
        return torch.randn(e_count, r, i, generator=g), torch.randn(e_count, o, r, generator=g)

    adapters = {0: [ab(8, h, 2 * inter), ab(4, inter, h)], 1: [None, ab(6, inter, h)]}
    ranges = [(0, 0, 7), (2, 7, 5), (1, 12, 6)]  # rows 18-23: the base; slot 2: no experts
    act = SiluAndMul() if activation == "silu" else SwigluOAIAndMul(1.702, 7.0)
    results = []
    for kernel, dev in (("torch", torch.device("cpu")), ("triton", device)):
        batch = LoRABatch(dev, kernel)
        lora = ExpertsLoRA(batch, 3, torch.float32, dev, e_count)
        for slot, slices in adapters.items():
            lora.set_slot(slot, slices)
        batch.set(ranges)
        args = [v.to(dev) for v in (x, w13, w2, weights, ids)]
        biases = (b13.to(dev), b2.to(dev))
        if kernel == "torch":
            out = experts_cpu(*args, biases=biases, activation=act, lora=lora)
        elif experts == "float":
            hooks = lora.fused_hooks(args[0], args[4], act)
            out = fused_moe.fused_experts(*args, biases, activation, (1.702, 7.0), hooks)
        else:
            hooks = lora.fused_hooks(args[0], args[4], act)
            out = fused_moe.fused_experts_quantized(
                args[0], q13, q2, args[3], args[4], biases, activation, (1.702, 7.0), hooks
            )
        results.append(out.cpu())
    plain = experts_cpu(x, w13, w2, weights, ids, biases=(b13, b2), activation=act)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(results[0][:7], plain[:7], atol=1e-3)  # slot 0's rows moved
    torch.testing.assert_close(results[1][18:], plain[18:], rtol=1e-4, atol=1e-4)


def _edit(src, dst, *, config=None, tensors=None):
    """A copy of the adapter folder src with its config and/or tensors edited."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    weights = load_file(str(src / "adapter_model.safetensors"))
    if config is not None:
        config(cfg)
    if tensors is not None:
        weights = tensors(weights)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(weights, str(dst / "adapter_model.safetensors"))
    return dst


def test_expert_adapter_refusals(tiny_qwen3_moe_dir, tiny_qwen2_moe_dir, tmp_path):
    """Each a ValueError naming the field or tensor: another model's experts, a bias as a
    target parameter, stacked weights on a dense layer, a missing half, DoRA, an expert past
    the model's count, and a shared expert's adapter on a model without one."""
    cfg = load_hf_config(tiny_qwen3_moe_dir)
    good = make_adapter(
        tiny_qwen3_moe_dir, tmp_path / "good", r=4, targets=["q_proj"],
        target_parameters=STACKED, seed=40,
    )  # fmt: skip
    read = read_adapter(good, cfg, 16)
    assert read.rank == 4 and set(read.target_modules) == {"q_proj", *STACKED_NAMES}

    def refused(folder, *words, **kwargs):
        with pytest.raises(ValueError) as e:
            read_adapter(folder, cfg, 16, check=True, **kwargs)
        for word in words:
            assert word in str(e.value), str(e.value)

    other = make_adapter(  # 16 experts, 8 here
        tiny_qwen2_moe_dir, tmp_path / "qwen2-moe", r=4, targets=[],
        target_parameters=STACKED, seed=41,
    )  # fmt: skip
    refused(other, "mlp.experts", "does not fit the base model", "expected (32, 64)")
    refused(
        _edit(good, tmp_path / "bias", config=lambda c: c.update(
            target_parameters=["mlp.experts.gate_up_proj_bias"])),
        "target_parameters", "gate_up_proj_bias",
    )  # fmt: skip

    def to_dense_layer(w):  # qwen3_moe's layer 1 is dense (mlp_only_layers)
        return {
            key.replace("layers.0.mlp.experts", "layers.1.mlp.experts"): v for key, v in w.items()
        }

    refused(_edit(good, tmp_path / "dense", tensors=to_dense_layer), "layer 1 has no experts")
    refused(
        _edit(good, tmp_path / "half", tensors=lambda w: {
            key: v for key, v in w.items()
            if not key.endswith("layers.2.mlp.experts.lora_B.weight")}),
        "layers.2.mlp.experts.down_proj.lora_B", "missing",
    )  # fmt: skip
    refused(_edit(good, tmp_path / "dora", config=lambda c: c.update(use_dora=True)), "use_dora")
    per_expert = make_per_expert_adapter(tiny_qwen3_moe_dir, tmp_path / "per", r=4, seed=42)
    past = cfg.num_experts

    def past_the_last(w):
        return {key.replace("experts.3.", f"experts.{past}."): v for key, v in w.items()}

    refused(_edit(per_expert, tmp_path / "past", tensors=past_the_last), f"expert {past}")
    shared = make_adapter(tiny_qwen2_moe_dir, tmp_path / "shared", r=4, targets=["gate_proj"])
    refused(shared, "mlp.shared_expert.gate_proj", "layer 0 has no shared expert")


STACKED_NAMES = ("gate_up_proj", "down_proj")
