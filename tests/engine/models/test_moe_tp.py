"""Tensor parallelism of the mixtures of experts: every expert split on its intermediate size
across 2 gloo ranks (w13 column-wise, w2 row-wise, one all-reduce after; Qwen2-MoE's shared
expert as the dense MLP) gives one process's logits."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.attention.backends.torch import TorchAttentionBackend
from engine.attention.metadata import common_metadata_from_seqs
from engine.models.loader import load_model

pytestmark = pytest.mark.slow

BLOCK = 8
PROMPT = [7, 99, 250, 3, 18, 41, 300, 5, 120, 64, 11]


def _logits(model_dir) -> torch.Tensor:
    from engine.distributed import get_tp_size

    model = load_model(model_dir, dtype="float32")
    cfg = model.config
    tp = get_tp_size()
    hkv, heads = cfg.num_key_value_heads // tp, cfg.num_attention_heads // tp
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 8, BLOCK, hkv, cfg.head_dim)
    backend = TorchAttentionBackend(BLOCK, heads, hkv, cfg.head_dim, torch.float32)
    for attn in model.attention_layers():
        attn.backend = backend
    with torch.inference_mode():
        meta = backend.build_metadata(common_metadata_from_seqs([(0, len(PROMPT), [5, 2])], BLOCK))
        a = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta))
        meta = backend.build_metadata(common_metadata_from_seqs([(len(PROMPT), 1, [5, 2])], BLOCK))
        b = model.compute_logits(model(torch.tensor([42]), torch.tensor([len(PROMPT)]), meta))
    return torch.cat([a, b])


def _worker(rank: int, port: int, model_dirs: list, out_file: str) -> None:
    from engine.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        results = [_logits(d) for d in model_dirs]
        if rank == 0:
            torch.save(results, out_file)
    finally:
        destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_moe_tp2_matches_tp1(tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_qwen3_moe_dir, tmp_path):
    torch.set_num_threads(1)
    dirs = [tiny_mixtral_dir, tiny_qwen2_moe_dir, tiny_qwen3_moe_dir]
    expected = [_logits(d) for d in dirs]
    out = tmp_path / "tp2.pt"
    mp.spawn(_worker, args=(_free_port(), dirs, str(out)), nprocs=2, join=True)
    for got, want in zip(torch.load(out), expected, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
