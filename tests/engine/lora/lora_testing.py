"""Adapters written by peft for the tiny random models of tests/conftest.py, and the
references: HF + peft's merged model (merge_and_unload), or peft's unmerged model (a tied
base with embed_tokens / lm_head adapters, which merging would fold into the one shared
weight), greedy, one prompt at a time."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_NEW = 8  # the tokens each request decodes in the engine tests


def expected_tokens(model_dir, adapters, prompts, assign, *, merge=True, num_new=NUM_NEW):
    """Each prompt's reference tokens for its adapter adapters[assign[i]] (None: the base
    model): HF + peft's merged model (merge=False: its unmerged LoRA layers), one model per
    adapter."""
    out: list[list[int] | None] = [None] * len(prompts)
    for which in set(assign):
        idx = [i for i, a in enumerate(assign) if a == which]
        adapter = None if which is None else adapters[which]
        ref = merged_greedy(model_dir, adapter, [prompts[i] for i in idx], num_new, merge=merge)
        for i, tokens in zip(idx, ref, strict=True):
            out[i] = tokens
    return out


def generate_tokens(model_dir, adapters, prompts, assign, *, num_new=NUM_NEW, **kwargs):
    """Greedy tokens of LLM(model_dir, enable_lora=True) in float32 on the CPU (128 KV blocks;
    kwargs override or add) for each prompt under adapters[assign[i]] (None: the base), all in
    one generate call: (the LLM, shut down after the call, and the tokens)."""
    from engine import LLM, LoRARequest, SamplingParams

    kwargs = {"num_kv_blocks": 128, "device": "cpu", **kwargs}
    llm = LLM(str(model_dir), dtype="float32", seed=0, enable_lora=True, **kwargs)
    try:
        loras = [
            None if a is None else LoRARequest(f"a{a}", a + 1, str(adapters[a])) for a in assign
        ]
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    seed: int = 0,
    use_rslora: bool = False,
    scale: float = 0.5,
    use_dora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    target_parameters: list[str] | None = None,
) -> Path:
    """A LoRA adapter with random A and B (peft's init_lora_weights=False would leave B as
    kaiming noise; B is redrawn here so the deltas are large enough to change greedy tokens
    but keep the logits peaked). An embedding's A [r, vocab] is drawn per token column (each
    token's delta as large as a projection's). DoRA: each magnitude is redrawn around its
    initial norm (x 0.5..1.5 per row), so no scale is 1. target_parameters: a mixture of
    experts' stacked projections (peft's ParamWrapper: A [r * E, in], B [out, r * E], each
    expert's part drawn as a projection's of rank r)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=ALL_TARGETS if targets is None else targets,
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        use_dora=use_dora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        target_parameters=target_parameters,
    )
    model = get_peft_model(base, config)
    experts = getattr(base.config, "num_local_experts", None) or getattr(
        base.config, "num_experts", 1
    )
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[0] ** 0.5)
            elif ".experts." in name and "lora_B" in name:  # [out, r * E]: rank r an expert
                p.copy_(torch.randn(p.shape, generator=g) * scale / (p.shape[1] / experts) ** 0.5)
            elif "lora_A" in name or "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
            elif "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
    model.save_pretrained(str(out_dir))
    return out_dir


def merged_greedy(
    model_dir: Path,
    adapter_dir: Path | None,
    prompts: list[list[int]],
    num_new: int,
    *,
    merge: bool = True,
) -> list[list[int]]:
    """Greedy tokens of HF's model with the adapter merged in (None: the base model);
    merge=False: through peft's unmerged LoRA layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
        if merge:
            model = model.merge_and_unload()
    model.eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(num_new):
                nxt = int(out.logits[0, -1].argmax())
                tokens.append(nxt)
                out = model(
                    input_ids=torch.tensor([[nxt]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
            results.append(tokens)
    return results


def make_per_expert_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    r: int = 8,
    alpha: int = 16,
    modules: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
    block: str = "mlp",
    seed: int = 0,
    scale: float = 0.5,
) -> Path:
    """An adapter on every expert's projections one by one, as peft wrote them for
    transformers 4's MoE models (each expert's gate/up/down an nn.Linear; Mixtral's w1 / w3 /
    w2 under block_sparse_moe): peft's own save_pretrained over that module tree, sized from
    the model's config.json (its MoE layers only)."""
    import json

    from peft import LoraConfig, get_peft_model
    from torch import nn

    cfg = json.loads((model_dir / "config.json").read_text())
    h = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    dense = set(cfg.get("mlp_only_layers") or [])
    gate, up, down = modules

    def expert() -> nn.Module:
        e = nn.Module()
        for name, (i, o) in ((gate, (h, inter)), (up, (h, inter)), (down, (inter, h))):
            setattr(e, name, nn.Linear(i, o, bias=False))
        return e

    def layer(i: int) -> nn.Module:
        decoder, moe = nn.Module(), nn.Module()
        moe.experts = nn.ModuleList([expert() for _ in range(experts)])
        setattr(decoder, block, moe if i not in dense else nn.Module())
        return decoder

    root, inner = nn.Module(), nn.Module()
    inner.layers = nn.ModuleList([layer(i) for i in range(cfg["num_hidden_layers"])])
    root.model = inner
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(modules), init_lora_weights=False
    )
    model = get_peft_model(root, config)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
    model.save_pretrained(str(out_dir))
    return out_dir
