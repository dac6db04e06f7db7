"""Adapters written by peft for the tiny random models of tests/conftest.py, and the
references: HF + peft's merged model (merge_and_unload), or peft's unmerged model (a tied
base with embed_tokens / lm_head adapters, which merging would fold into the one shared
weight), greedy, one prompt at a time."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
) -> Path:
    """A LoRA adapter with random A and B (peft's init_lora_weights=False would leave B as
    kaiming noise; B is redrawn here so the deltas are large enough to change greedy tokens
    but keep the logits peaked). An embedding's A [r, vocab] is drawn per token column (each
    token's delta as large as a projection's). DoRA: each magnitude is redrawn around its
    initial norm (x 0.5..1.5 per row), so no scale is 1."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        init_lora_weights=False,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        use_dora=use_dora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
    )
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[0] ** 0.5)
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
