"""EAGLE-1 heads end to end on a tiny one-layer Llama: greedy output token for token the same
as plain decoding with a random head and with a head built to mirror the target (accepted
most of the time: the features, positions and the head's K/V are wired as EAGLE reads them),
across preemption, chunked prefill and prefix hits; the checkpoint refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from eagle_heads import eagle_prompts, generate_greedy

from engine import LLM


def _edit(folder, change) -> None:
    from safetensors.torch import load_file, save_file

    for f in folder.glob("*.safetensors"):
        tensors = change(load_file(f))
        save_file({k: v.contiguous() for k, v in tensors.items()}, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def target_dir(make_tiny_model, tmp_path_factory):
    """One layer, unit norms and unit-RMS embedding rows: then its layer applied to the
    embeddings is exactly what an EAGLE head (no input norm) computes, and argmax of the
    LM head is the same with or without the final norm."""
    base = make_tiny_model("tiny-llama-1layer", num_hidden_layers=1, seed=4)
    folder = tmp_path_factory.mktemp("eagle-target") / "model"
    shutil.copytree(base, folder)

    def unit(t):
        out = {}
        for k, v in t.items():
            if k.endswith("layernorm.weight") and "input" in k or k == "model.norm.weight":
                v = torch.ones_like(v)
            elif k == "model.embed_tokens.weight":
                v = v / v.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)  # (zero rows)
            out[k] = v
        return out

    _edit(folder, unit)
    return folder


def _head(target_dir, folder, mirror: bool):
    """An EAGLE-1 checkpoint for target_dir: fc [H, 2H] and layers.0.* (and a copy of the
    embedding, which the head must ignore). mirror: fc picks the token's embedding and the
    layer is the target's; else random."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    weights = load_file(next(target_dir.glob("*.safetensors")))
    h = cfg["hidden_size"]
    g = torch.Generator().manual_seed(9)
    out = {"embed_tokens.weight": weights["model.embed_tokens.weight"]}
    for k, v in weights.items():
        if k.startswith("model.layers.0.") and "input_layernorm" not in k:
            out[k.removeprefix("model.")] = v if mirror else torch.randn(v.shape, generator=g) * 0.1
    if mirror:
        out["fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
    else:
        out["fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    save_file({k: v.contiguous() for k, v in out.items()}, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def mirror_head(target_dir, tmp_path_factory):
    return _head(target_dir, tmp_path_factory.mktemp("eagle-mirror"), mirror=True)


@pytest.fixture(scope="module")
def random_head(target_dir, tmp_path_factory):
    return _head(target_dir, tmp_path_factory.mktemp("eagle-random"), mirror=False)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_kv_blocks": 9, "max_model_len": 128, "max_num_batched_tokens": 32}],
    ids=["plain", "preempt-chunked"],
)
def test_mirror_head_greedy_identical_and_mostly_accepted(target_dir, mirror_head, kwargs):
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    prompts = eagle_prompts(vocab)
    waves = [prompts, [p + [7] for p in prompts[2:]]]  # the second wave hits cached blocks
    ref, _, _, _, _ = generate_greedy(target_dir, None, waves, **kwargs)
    spec = {"method": "eagle", "model": str(mirror_head), "num_speculative_tokens": 3}
    got, stats, hits, leaked, preempted = generate_greedy(target_dir, spec, waves, **kwargs)
    assert got == ref
    assert hits > 0 and leaked == 0
    if kwargs:
        assert preempted > 0
    # The head sees every token but the first, shifted one position: it agrees with the
    # target on most drafts (a head reading the wrong rows or K/V would agree on ~none).
    assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens, stats


def test_random_head_greedy_identical(target_dir, random_head):
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    waves = [eagle_prompts(vocab)]
    ref, _, _, _, _ = generate_greedy(target_dir, None, waves)
    spec = {"method": "eagle", "model": str(random_head), "num_speculative_tokens": 2}
    got, stats, _, leaked, _ = generate_greedy(target_dir, spec, waves)
    assert got == ref and leaked == 0
    assert stats.num_draft_tokens > 0


def test_refusals(target_dir, mirror_head, tmp_path):
    wide = tmp_path / "wide"
    shutil.copytree(mirror_head, wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128}))
    with pytest.raises(ValueError, match="hidden size 128"):
        LLM(
            str(target_dir),
            dtype="float32",
            speculative_config={"method": "eagle", "model": str(wide)},
        )
    odd = tmp_path / "odd"
    shutil.copytree(mirror_head, odd)
    _edit(odd, lambda t: {**t, "layers.1.mlp.down_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="not an EAGLE-1 head"):
        LLM(
            str(target_dir),
            dtype="float32",
            speculative_config={"method": "eagle", "model": str(odd)},
        )
