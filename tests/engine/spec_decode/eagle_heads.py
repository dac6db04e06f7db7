"""Tiny targets and EAGLE-3 heads in vLLM's checkpoint layout (LlamaForCausalLMEagle3:
fc, midlayer.*, norm, lm_head over a draft vocabulary, d2t / t2d), for the spec-decode tests,
and the greedy runs the EAGLE tests share.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def eagle_prompts(vocab: int, first: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, vocab, (first + 6 * i,), generator=g).tolist() for i in range(5)]
    return [*prompts, prompts[3] + [5, 6]]


def generate_greedy(target_dir, spec, waves, graphs: dict | None = None, **kwargs):
    """Greedy outputs of each wave of prompts on target_dir with spec (None: plain decoding),
    and the run's spec counters, prefix-cache hits, leaked blocks and preemptions. graphs, if
    given: receives the graph runners the steps went through (graphs_testing.py: set
    TESSERA_STEP_GRAPH=replay first)."""
    from engine import LLM, SamplingParams

    # drafts at every step: the drafting itself is under test (the controller: test_controller.py)
    spec = {**spec, "adaptive": False} if spec else None
    llm = LLM(
        str(target_dir), dtype="float32", speculative_config=spec, async_scheduling=False, **kwargs
    )
    if graphs is not None:
        from graphs_testing import step_graphs

        graphs["target"], graphs["draft"] = step_graphs(llm)
    outs = []
    for prompts in waves:
        params = [
            SamplingParams(max_tokens=16 + 2 * i, temperature=0.0, ignore_eos=True)
            for i in range(len(prompts))
        ]
        outs += [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    scheduler = llm.engine.scheduler
    stats = scheduler.stats().spec_decoding
    hits = scheduler.kv_cache_manager.prefix_cache_hits
    leaked = llm.engine.num_blocks - 1 - scheduler.kv_cache_manager.num_free_blocks
    preempted = scheduler.num_preemptions
    llm.shutdown()
    return outs, stats, hits, leaked, preempted


def edit_weights(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = change(load_file(f))
        save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})


def one_layer_in_effect(base: Path, folder: Path) -> Path:
    """base with embedding rows of RMS 1e-3 and every layer but the first adding nothing
    (o_proj and down_proj zero): the output is layer 0's attention and MLP on the token,
    which an EAGLE-3 head (no residual of the token's embedding) can mirror."""
    shutil.copytree(base, folder)

    def change(t):
        out = {}
        for k, v in t.items():
            if k == "model.embed_tokens.weight":
                rms = v.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)  # (zero rows)
                v = v / rms * 1e-3
            elif not k.startswith("model.layers.0.") and k.endswith(
                ("o_proj.weight", "down_proj.weight")
            ):
                v = torch.zeros_like(v)
            out[k] = v
        return out

    edit_weights(folder, change)
    return folder


def draft_vocab_ids(vocab: int) -> list[int]:
    """The target ids of a draft vocabulary: all but every 31st id, in reverse order (d2t is
    then nowhere zero but at one id: a head that ignored it would draft nonsense)."""
    return [t for t in reversed(range(vocab)) if t % 31 != 3]


def eagle3_head(
    target_dir: Path,
    folder: Path,
    mirror: bool,
    aux_layers: list[int] | None = None,
    own_embed: bool = False,
    seed: int = 9,
) -> Path:
    """An EAGLE-3 checkpoint for target_dir. mirror: the midlayer is the target's layer 0
    reading only the embedding half (q/k/v [W, 0]), hidden_norm zero with
    norm_before_residual (the feature adds nothing), the target's final norm and its LM
    head's rows of the draft vocabulary; else random weights (the feature matters)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target_dir / "config.json").read_text())
    keep = draft_vocab_ids(cfg["vocab_size"])
    head_cfg = {
        **cfg,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": len(keep),
        "target_hidden_size": cfg["hidden_size"],
        "norm_before_residual": mirror,
    }
    if aux_layers is not None:
        head_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (folder / "config.json").write_text(json.dumps(head_cfg))
    weights = load_file(next(target_dir.glob("*.safetensors")))
    h = cfg["hidden_size"]
    n_aux = len(aux_layers) if aux_layers is not None else 3
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(shape, generator=g) * scale

    out = {}
    for k, v in weights.items():
        if not k.startswith("model.layers.0."):
            continue
        name = "midlayer." + k.removeprefix("model.layers.0.")
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            v = torch.cat((v, torch.zeros_like(v)), dim=1) if mirror else rand(v.shape[0], 2 * h)
        elif not mirror:
            v = 1 + rand(*v.shape) if "layernorm" in k else rand(*v.shape)
        out[name] = v
    out["midlayer.hidden_norm.weight"] = torch.zeros(h) if mirror else 1 + rand(h)
    out["fc.weight"] = torch.zeros(h, n_aux * h) if mirror else rand(h, n_aux * h)
    out["norm.weight"] = weights["model.norm.weight"] if mirror else 1 + rand(h)
    ids = torch.tensor(keep)
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    out["lm_head.weight"] = lm_head[ids] if mirror else rand(len(keep), h, scale=1.0)
    out["d2t"] = ids - torch.arange(len(keep))
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    if own_embed:
        out["embed_tokens.weight"] = rand(cfg["vocab_size"], h, scale=1.0)
    save_file({k: v.contiguous() for k, v in out.items()}, folder / "model.safetensors")
    return folder
