"""The paged attention path against HF transformers, logits at every position, in float32.

One flattened batch mixes decode tokens of three sequences with different context lengths,
a full prefill, and a prefill chunk whose prefix was cached by an earlier step; blocks are
shuffled so no sequence's blocks are contiguous.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import cpu_kernel
from engine.attention.backends.cpu import CpuAttentionBackend
from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.metadata import common_metadata_from_seqs
from engine.models.loader import load_model

BLOCK = 8


class PagedHarness:
    """A model with a bound KV cache and a shuffled block allocator, stepping by hand."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0, cpu_kernel=False, **kw):
        cfg = model.config
        self.model = model
        self.caches = [
            torch.zeros(2, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
            for _ in range(cfg.num_hidden_layers)
        ]
        for attn, cache in zip(model.attention_layers(), self.caches, strict=True):
            attn.kv_cache = cache
        self.free = list(range(1, num_blocks))  # block 0 is reserved
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.backend = (CpuAttentionBackend if cpu_kernel else TorchAttentionBackend)(
            BLOCK,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            torch.float32,
            **kw,
        )
        for attn in model.attention_layers():
            attn.backend = self.backend

    def step(self, chunks: list[tuple[str, list[int], int]]) -> torch.Tensor:
        """chunks: (seq id, token ids, start position); decodes first. -> logits [T, V]."""
        seqs, ids, pos = [], [], []
        for sid, toks, start in chunks:
            table = self.blocks.setdefault(sid, [])
            while len(table) * BLOCK < start + len(toks):
                table.append(self.free.pop())
            seqs.append((start, len(toks), table))
            ids += toks
            pos += range(start, start + len(toks))
        meta = self.backend.build_metadata(common_metadata_from_seqs(seqs, BLOCK))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta)
            return self.model.compute_logits(hidden)


def _hf_logits(model_dir, seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return {k: hf(torch.tensor([v])).logits[0] for k, v in seqs.items()}


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama3_dir"])
@pytest.mark.parametrize(
    "decode", ["one-group", "two-groups", "cpu-kernel"], ids=lambda x: f"decode-{x}"
)
def test_mixed_batch_matches_hf(request, model_fixture, decode):
    torch.set_num_threads(1)
    model_dir = request.getfixturevalue(model_fixture)
    model = load_model(model_dir, dtype="float32")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = {"full": 13, "chunked": 30, "d1": 10, "d2": 21, "d3": 34}
    seqs = {k: torch.randint(3, vocab, (n,), generator=g).tolist() for k, n in lens.items()}
    ref = _hf_logits(model_dir, seqs)

    if decode == "cpu-kernel":
        if not cpu_kernel.kernel_supports(torch.float32, torch.device("cpu"), 2, 16):
            pytest.skip("no C compiler for the CPU kernel")
        h = PagedHarness(model, cpu_kernel=True)
    else:
        groups = 1 if decode == "one-group" else 2
        h = PagedHarness(model, decode_group_size=1, max_decode_groups=groups)
    # Step 1: cache the decoders' contexts and the first chunk of "chunked".
    step1 = [(k, seqs[k][:-1], 0) for k in ("d1", "d2", "d3")] + [
        ("chunked", seqs["chunked"][:17], 0)
    ]
    logits1 = h.step(step1)
    assert torch.allclose(logits1[-17:], ref["chunked"][:17], atol=1e-4)

    # Step 2: three decodes (sorted by context), a full prefill, a chunk with cached prefix.
    step2 = [(k, seqs[k][-1:], lens[k] - 1) for k in ("d1", "d2", "d3")]
    step2 += [("full", seqs["full"], 0), ("chunked", seqs["chunked"][17:], 17)]
    logits = h.step(step2)
    rows = iter(range(logits.shape[0]))
    for k in ("d1", "d2", "d3"):
        torch.testing.assert_close(logits[next(rows)], ref[k][-1], atol=1e-4, rtol=0)
    full = torch.stack([logits[next(rows)] for _ in range(13)])
    torch.testing.assert_close(full, ref["full"], atol=1e-4, rtol=0)
    chunk = torch.stack([logits[next(rows)] for _ in range(13)])
    torch.testing.assert_close(chunk, ref["chunked"][17:], atol=1e-4, rtol=0)


def test_decode_steps_follow_hf_greedy(tiny_llama_dir):
    """Ten greedy decode steps through the paged cache give HF's greedy continuation."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = load_model(tiny_llama_dir, dtype="float32")
    prompt = [5, 17, 200, 33, 41, 90, 7]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    h = PagedHarness(model)
    toks = list(prompt)
    nxt = int(h.step([("s", toks, 0)])[-1].argmax())
    out = [nxt]
    for _ in range(9):
        toks.append(nxt)
        nxt = int(h.step([("s", [nxt], len(toks) - 1)])[-1].argmax())
        out.append(nxt)
    assert out == expected
