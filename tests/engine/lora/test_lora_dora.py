"""Per-module ranks and alphas (rank_pattern / alpha_pattern, with use_rslora) and DoRA
(use_dora): greedy tokens of each request equal HF + peft's (its unmerged layers) for its
adapter, in one batch mixing them with a plain adapter and the base model, on the torch and C
kernel paths (the Triton kernels under the interpreter) and under TP=2; over models with
biases on every projection (DoRA scales the product, never the bias). Refusals name the field
and leave nothing queued or loaded."""

from __future__ import annotations

import os

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter import pattern_key, read_adapter
from engine.models.hf_config import load_hf_config
from tests.engine.lora.lora_testing import NUM_NEW, expected_tokens, make_adapter, merged_greedy

KINDS = ("plain", "pattern", "dora")
# ranks 2..16 and alphas by module, regexes anchored and not (peft's get_pattern_key)
RANKS = {"v_proj": 2, "^model.layers.1.mlp.*": 16, r"layers\.2\.self_attn\.q_proj": 12}
ALPHAS = {"o_proj": 3, "gate_proj": 40}


@pytest.fixture(scope="module")
def biased_llama_dir(make_tiny_model):
    """A tiny Llama with (random) biases on q/k/v/o and gate/up/down."""
    return make_tiny_model("tiny-llama-bias", attention_bias=True, mlp_bias=True, seed=3)


def _adapters(model_dir, root, seed, dora_targets=None):
    """A plain adapter, one with per-module ranks and alphas, a DoRA one (dora_targets: its
    modules, all seven by default)."""
    return {
        "plain": make_adapter(model_dir, root / "plain", r=8, alpha=16, seed=seed),
        "pattern": make_adapter(
            model_dir, root / "pattern", r=4, alpha=8, use_rslora=True, seed=seed + 1,
            rank_pattern=RANKS, alpha_pattern=ALPHAS,
        ),
        "dora": make_adapter(
            model_dir, root / "dora", r=8, alpha=8, use_dora=True, seed=seed + 2,
            rank_pattern={"down_proj": 4}, alpha_pattern={"q_proj": 12}, targets=dora_targets,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def biased_adapters(biased_llama_dir, tmp_path_factory):
    return _adapters(biased_llama_dir, tmp_path_factory.mktemp("dora-adapters"), seed=40)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 19, 33, 11, 24, 40, 8, 17]
    return [torch.randint(3, vocab, (lengths[i % 8],), generator=g).tolist() for i in range(n)]


def _expected(model_dir, adapters, prompts, assign):
    """peft's tokens for each prompt's adapter (None: the base model)."""
    return expected_tokens(model_dir, adapters, prompts, assign, merge=False)


def _requests(adapters, assign):
    return [
        None if a is None else LoRARequest(a, KINDS.index(a) + 1, str(adapters[a])) for a in assign
    ]


def _generate(llm, adapters, prompts, assign):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=_requests(adapters, assign), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_pattern_keys_match_peft():
    from peft.utils.other import get_pattern_key

    names = [
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.2.self_attn.q_proj",
        "model.layers.12.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    keys = [*RANKS, *ALPHAS, "proj", "q_proj", "layers.1.mlp.gate_proj"]
    for name in names:
        want = get_pattern_key(keys, name)
        assert (pattern_key(keys, name) or name) == want


def test_modules_keep_their_own_ranks_and_scalings(biased_llama_dir, biased_adapters):
    """What read_adapter makes of the patterns: each module's rank, and its alpha / sqrt(r)
    (use_rslora) folded into B."""
    import json

    from safetensors.torch import load_file

    cfg = load_hf_config(biased_llama_dir)
    path = biased_adapters["pattern"]
    adapter = read_adapter(path, cfg, 16)
    raw = load_file(str(path / "adapter_model.safetensors"))
    assert json.loads((path / "adapter_config.json").read_text())["rank_pattern"] == RANKS
    want = {  # (layer, module): (rank, alpha)
        (0, "v_proj"): (2, 8), (1, "gate_proj"): (16, 40), (1, "up_proj"): (16, 8),
        (1, "down_proj"): (16, 8), (2, "q_proj"): (12, 8), (0, "q_proj"): (4, 8),
        (2, "o_proj"): (4, 3), (0, "gate_proj"): (4, 40),
    }  # fmt: skip
    for (layer, module), (r, alpha) in want.items():
        a, b = adapter.weights[(layer, module)]
        assert a.shape[0] == r and b.shape[1] == r
        key = next(
            k for k in raw if f"layers.{layer}." in k and k.endswith(f"{module}.lora_B.weight")
        )
        torch.testing.assert_close(b, raw[key] * (alpha / r**0.5))
    assert adapter.rank == 16 and not adapter.use_dora
    dora = read_adapter(biased_adapters["dora"], cfg, 16)
    assert dora.use_dora and set(dora.magnitudes) == set(dora.weights)


@pytest.mark.parametrize("kernel", ["torch", "cpu"])
def test_mixed_batch_matches_peft(biased_llama_dir, biased_adapters, kernel, monkeypatch):
    """plain, per-module-rank and DoRA adapters and the base model in one batch: rows of one
    adapter apart (an index gather) and together, prefill and decode."""
    from engine.kernels.cpu import lora as cpu_lora

    if kernel == "cpu" and not cpu_lora.available():
        pytest.skip("CPU kernels not built")
    monkeypatch.setenv("TESSERA_LORA_KERNEL", kernel)
    vocab = load_hf_config(biased_llama_dir).vocab_size
    prompts = _prompts(vocab, 8, seed=31)
    assign = ["dora", None, "pattern", "plain", "dora", "pattern", None, "dora"]
    want = _expected(biased_llama_dir, biased_adapters, prompts, assign)
    base = merged_greedy(biased_llama_dir, None, prompts, NUM_NEW)
    assert all(want[i] != base[i] for i, a in enumerate(assign) if a is not None)
    llm = LLM(
        str(biased_llama_dir), dtype="float32", seed=0, enable_lora=True, max_loras=3,
        num_kv_blocks=128,
    )  # fmt: skip
    try:
        manager = llm.engine.executor.runner.lora_manager
        assert manager.batch.kernel == kernel
        got = _generate(llm, biased_adapters, prompts, assign)
        assert llm.engine.scheduler.stats().kv_usage == 0.0
        # the DoRA scale applies only to steps that hold a DoRA adapter's rows
        dora_id = KINDS.index("dora") + 1
        slots = {lid: s for s, lid in enumerate(manager.slots)}
        assert manager._slot_dora[slots[dora_id]] and sum(manager._slot_dora) == 1
        req = _requests(biased_adapters, ["plain", "pattern", "dora"])
        manager.prepare([(req[0], 0, 3), (None, 3, 2), (req[1], 5, 1)])
        assert manager.batch.active and not manager.batch.dora and not manager.graph_blockers
        manager.prepare([(req[0], 0, 3), (req[2], 3, 2)])
        assert manager.batch.dora and manager.graph_blockers == {"dora"}
        manager.prepare([(None, 0, 2)])
        assert not manager.graph_blockers and not manager.batch.active
    finally:
        llm.shutdown()
    assert got == want


def test_qwen2_dora_with_qkv_bias_and_tied_embeddings(tiny_qwen2_dir, tmp_path):
    """Qwen2 (biases on q/k/v); DoRA on q and v but not k, up but not gate: the merged
    layers' untargeted slices keep a scale of 1."""
    dora_targets = ["q_proj", "v_proj", "up_proj", "down_proj"]
    adapters = _adapters(tiny_qwen2_dir, tmp_path, seed=50, dora_targets=dora_targets)
    vocab = load_hf_config(tiny_qwen2_dir).vocab_size
    prompts = _prompts(vocab, 5, seed=33)
    assign = ["dora", "pattern", None, "dora", "plain"]
    want = _expected(tiny_qwen2_dir, adapters, prompts, assign)
    llm = LLM(
        str(tiny_qwen2_dir), dtype="float32", seed=0, enable_lora=True, max_loras=3,
        num_kv_blocks=128,
    )  # fmt: skip
    try:
        got = _generate(llm, adapters, prompts, assign)
    finally:
        llm.shutdown()
    assert got == want


def test_fewer_slots_swap_dora_in_and_out(biased_llama_dir, biased_adapters, monkeypatch):
    """max_loras=1, max_cpu_loras=1: a slot goes from a DoRA adapter to plain ones and back
    (its scale is set and dropped with it), each reloaded from its folder; the norms taken 5
    rows at a time (no layer's rows a multiple of it)."""
    monkeypatch.setattr("engine.lora.manager.DORA_ROWS", 5)
    vocab = load_hf_config(biased_llama_dir).vocab_size
    prompts = _prompts(vocab, 5, seed=35)
    assign = ["dora", "plain", "dora", None, "pattern"]
    want = _expected(biased_llama_dir, biased_adapters, prompts, assign)
    llm = LLM(
        str(biased_llama_dir), dtype="float32", seed=0, enable_lora=True, max_loras=1,
        max_cpu_loras=1, num_kv_blocks=128,
    )  # fmt: skip
    try:
        got = _generate(llm, biased_adapters, prompts, assign)
        manager = llm.engine.executor.runner.lora_manager
        assert manager.num_swaps >= 3
        assert llm.engine.scheduler.stats().kv_usage == 0.0
    finally:
        llm.shutdown()
    assert got == want


def test_the_triton_kernels_serve_them(biased_llama_dir, biased_adapters, monkeypatch):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    monkeypatch.setenv("TESSERA_LORA_KERNEL", "triton")
    vocab = load_hf_config(biased_llama_dir).vocab_size
    prompts = _prompts(vocab, 4, seed=37)
    assign = ["pattern", "dora", None, "plain"]
    want = _expected(biased_llama_dir, biased_adapters, prompts, assign)
    llm = LLM(
        str(biased_llama_dir), dtype="float32", seed=0, enable_lora=True, max_loras=3,
        num_kv_blocks=128,
    )  # fmt: skip
    try:
        assert llm.engine.executor.runner.lora_manager.batch.kernel == "triton"
        got = _generate(llm, biased_adapters, prompts, assign)
    finally:
        llm.shutdown()
    assert got == want


@pytest.mark.slow
def test_tp2_mixed_batch_matches_peft(biased_llama_dir, biased_adapters):
    """TP=2 (gloo): column-parallel layers take their rows of the DoRA scale, row-parallel
    ones sum the ranks' partial squares for its norm and rescale after the all-reduce, before
    the bias."""
    torch.set_num_threads(1)
    vocab = load_hf_config(biased_llama_dir).vocab_size
    prompts = _prompts(vocab, 5, seed=39)
    assign = ["dora", "pattern", None, "plain", "dora"]
    want = _expected(biased_llama_dir, biased_adapters, prompts, assign)
    llm = LLM(
        str(biased_llama_dir), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
        device="cpu", enable_lora=True, max_loras=3,
    )  # fmt: skip
    try:
        got = _generate(llm, biased_adapters, prompts, assign)
        assert llm.engine.scheduler.stats().kv_usage == 0.0
    finally:
        llm.shutdown()
    assert got == want


# -- refusals ---------------------------------------------------------------------------


def _edited(src, dst, **fields):
    import json
    import shutil

    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))
    return dst


def test_refusals_name_the_field(biased_llama_dir, biased_adapters, tmp_path):
    """Over the offline API: nothing queued, loaded or held in a slot; the engine goes on."""
    pattern, dora = biased_adapters["pattern"], biased_adapters["dora"]
    cases = [
        (_edited(pattern, tmp_path / "big", rank_pattern={**RANKS, "v_proj": 32}),
         r"rank_pattern: 'v_proj' gives model\.layers\.0\.self_attn\.v_proj rank 32, above max_lora_rank \(16\)"),
        (_edited(pattern, tmp_path / "bad-r", rank_pattern={"v_proj": 0}),
         "rank_pattern: 'v_proj': must be a positive integer"),
        (_edited(pattern, tmp_path / "bad-a", alpha_pattern=["o_proj"]),
         "alpha_pattern: must be an object"),
        (_edited(dora, tmp_path / "dora-head", target_modules=["q_proj", "lm_head"]),
         "use_dora: DoRA on embed_tokens / lm_head is not supported"),
        (_edited(dora, tmp_path / "not-dora", use_dora=False),
         "lora_magnitude_vector: a DoRA magnitude, but use_dora is not set"),
        (_edited(biased_adapters["plain"], tmp_path / "no-m", use_dora=True),
         r"lora_magnitude_vector: missing \(use_dora is set\)"),
    ]  # fmt: skip
    cfg = load_hf_config(biased_llama_dir)
    for path, message in cases:
        for check in (True, False):
            with pytest.raises(ValueError, match=message):
                read_adapter(path, cfg, 16, check=check)
    llm = LLM(
        str(biased_llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        for i, (path, message) in enumerate(cases, start=10):
            with pytest.raises(ValueError, match=message):
                llm.generate(
                    [[5, 6, 7], [8, 9]], params, lora_request=[None, LoRARequest("x", i, str(path))]
                )
        engine = llm.engine
        manager = engine.executor.runner.lora_manager
        assert not engine.has_unfinished_requests() and not engine._adapters
        assert manager.num_loads == 0 and manager.slots == [None, None]
        assert engine.scheduler.stats().kv_usage == 0.0
        ok = LoRARequest("dora", 1, str(dora))
        assert len(llm.generate([[5, 6, 7]], params, lora_request=ok)[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_dora_over_quantized_weights_is_refused(biased_llama_dir, biased_adapters):
    """int8 base weights: DoRA's norm is of the float weights peft saw; refused naming
    use_dora, while a plain adapter and one with per-module ranks are served."""
    llm = LLM(
        str(biased_llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True,
        max_loras=2, quantization="int8",
    )  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        dora = LoRARequest("dora", 1, str(biased_adapters["dora"]))
        with pytest.raises(ValueError, match=r"use_dora: DoRA over a quantized base model \(quantization 'int8'\)"):  # fmt: skip
            llm.generate([[5, 6, 7], [8, 9]], params, lora_request=[None, dora])
        assert not llm.engine.has_unfinished_requests()
        manager = llm.engine.executor.runner.lora_manager
        assert manager.num_loads == 0
        # the runner's own check, should a DoRA folder reach it
        with pytest.raises(ValueError, match="use_dora: DoRA over quantized base weights"):
            manager.prepare([(dora, 0, 3)])
        assert manager.slots == [None, None] and not manager._cpu
        reqs = _requests(biased_adapters, ["plain", "pattern"])
        outs = llm.generate([[5, 6, 7], [8, 9]], params, lora_request=reqs)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    finally:
        llm.shutdown()


def test_a_bf16_model_on_bf16_slots_gives_the_float32_slots_tokens(
    biased_llama_dir, biased_adapters, monkeypatch
):
    """bf16 model: the C kernel's bf16 slots against the torch path's float32 slots, with
    DoRA's scales (float32 either way) and per-module ranks, in one mixed batch: token for
    token, but where the float32 slots' own choice was a near tie (top-2 logprob gap under
    0.05, a few bf16 steps: B rounded to bf16 moves the logits by about that; the rest of
    that prompt then follows another path and is not compared)."""
    from engine.kernels.cpu import lora as cpu_lora

    if not cpu_lora.available():
        pytest.skip("CPU kernels not built")
    vocab = load_hf_config(biased_llama_dir).vocab_size
    prompts = _prompts(vocab, 6, seed=41)
    assign = ["dora", "pattern", None, "plain", "dora", "pattern"]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for kernel in ("torch", "cpu"):
        monkeypatch.setenv("TESSERA_LORA_KERNEL", kernel)
        llm = LLM(
            str(biased_llama_dir), dtype="bfloat16", seed=0, enable_lora=True, max_loras=3,
            num_kv_blocks=128,
        )  # fmt: skip
        try:
            manager = llm.engine.executor.runner.lora_manager
            reqs = _requests(biased_adapters, assign)
            outs = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
            runs[kernel] = ([o.outputs[0] for o in outs], manager.dtype)
        finally:
            llm.shutdown()
    assert runs["torch"][1] == torch.float32 and runs["cpu"][1] == torch.bfloat16
    parted = 0
    for ours, ref in zip(runs["cpu"][0], runs["torch"][0], strict=True):
        for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True)):
            if a != b:
                top = ref.logprobs[i].top
                gap = top[0][1] - top[1][1]
                assert gap < 0.05, f"token {i}: {a} != {b}, top-2 gap {gap:.4f}"
                parted += 1
                break
    assert parted <= 2, "more than a few near ties: the slots disagree"
