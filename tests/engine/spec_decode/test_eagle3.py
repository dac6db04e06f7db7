"""EAGLE-3 heads end to end on tiny Llamas: greedy output token for token the same as plain
decoding with a random head (its own embedding, the features reading the target's layers)
and with a head built to mirror the target (accepted most of the time: embeddings,
positions, the head's K/V and the draft vocabulary's d2t map wired as vLLM reads them),
across preemption, chunked prefill and prefix hits; the layers the target hands the head
against HF's output_hidden_states; the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from eagle_heads import (
    eagle3_head,
    eagle_prompts,
    edit_weights,
    generate_greedy,
    one_layer_in_effect,
)
from graphs_testing import REPLAY

from engine import LLM, SamplingParams
from engine.attention.metadata import common_metadata_from_seqs
from engine.models.pipeline import IntermediateTensors
from engine.spec_decode.eagle3 import aux_layer_ids


@pytest.fixture(scope="module")
def mirror_target(tiny_llama_dir, tmp_path_factory):
    return one_layer_in_effect(tiny_llama_dir, tmp_path_factory.mktemp("eagle3-target") / "m")


@pytest.fixture(scope="module")
def mirror_head(mirror_target, tmp_path_factory):
    return eagle3_head(mirror_target, tmp_path_factory.mktemp("eagle3-mirror"), mirror=True)


@pytest.fixture(scope="module")
def random_head(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3-random")
    return eagle3_head(tiny_llama_dir, folder, mirror=False, own_embed=True)


CASES = [{}, {"num_kv_blocks": 9, "max_model_len": 128, "max_num_batched_tokens": 32}]


def _waves(target_dir, first: int = 6):
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    prompts = eagle_prompts(vocab, first)
    return [prompts, [p + [7] for p in prompts[2:]]]  # the second wave hits cached blocks


@pytest.mark.parametrize("kwargs", CASES, ids=["plain", "preempt-chunked"])
def test_mirror_head_greedy_identical_and_mostly_accepted(mirror_target, mirror_head, kwargs):
    waves = _waves(mirror_target, first=24)
    ref, _, _, _, _ = generate_greedy(mirror_target, None, waves, **kwargs)
    spec = {"method": "eagle3", "model": str(mirror_head), "num_speculative_tokens": 3}
    spec["draft_backoff"] = False
    got, stats, hits, leaked, preempted = generate_greedy(mirror_target, spec, waves, **kwargs)
    assert got == ref
    assert hits > 0 and leaked == 0
    if kwargs:
        assert preempted > 0
    # The head computes the target's layer on every token but the first (its keys and
    # values sit one position back): the target on the context less its first token, which
    # (HF, this target) picks the same next token ~62% of the time. A head reading the wrong
    # embeddings, positions, K/V or draft ids (d2t) would agree on ~none.
    assert stats.accepted_per_pos[0] > 0.5 * stats.num_drafts, stats
    assert stats.num_accepted_tokens > 0.35 * stats.num_draft_tokens, stats


def test_target_steps_replay_in_cuda_graphs_with_the_heads_layers(
    mirror_target, mirror_head, monkeypatch
):
    """CUDA graphs' logic on the CPU (graphs_testing.py): the target's decode and verification
    steps replay graphs that keep the head's layer inputs as outputs of their own, handed back
    as the step's rows (checked row by row in test_cuda_graph.py); plain decoding's tokens
    across preemption and chunked prefill, the mirror head accepted as often as eagerly."""
    waves = _waves(mirror_target, first=12)
    kwargs = {**CASES[1], "attention_backend": "torch", "max_num_seqs": 4}
    ref, _, _, _, _ = generate_greedy(mirror_target, None, waves, **kwargs)
    spec = {"method": "eagle3", "model": str(mirror_head), "num_speculative_tokens": 3}
    spec["draft_backoff"] = False
    monkeypatch.setenv(*REPLAY)
    graphs: dict = {}
    got, stats, _, leaked, preempted = generate_greedy(mirror_target, spec, waves, graphs, **kwargs)
    assert got == ref and leaked == 0 and preempted > 0
    assert stats.accepted_per_pos[0] > 0.5 * stats.num_drafts, stats
    target, head = graphs["target"], graphs["draft"]
    assert target._aux is not None and target.verify_len == 4
    assert sum(target.verify_runs.values()) >= 10 and sum(target.runs.values()) > 0
    # the head's forwards too: its feeds (up to k + 1 rows a request), its one-token steps
    assert head.verify_len == 4 and sum(head.verify_runs.values()) >= 10
    assert sum(head.runs.values()) >= 10


def test_the_heads_forwards_replay_in_cuda_graphs(tiny_llama_dir, random_head, monkeypatch):
    """The head's forwards through its own graphs (a stage after the target: the features
    in a static buffer at the step's rows, both outputs gathered back): a feed of 1-4 rows a
    request and a one-token step give the eager forward's outputs. A random head: the
    features change them (a mirror head's ignore them)."""
    import random

    from engine.worker.step_graph import StepInputs, run_step

    monkeypatch.setenv(*REPLAY)
    spec = {"method": "eagle3", "model": str(random_head), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_llama_dir), dtype="float32", attention_backend="torch", max_num_seqs=4,
              num_kv_blocks=64, speculative_config=spec, async_scheduling=False)  # fmt: skip
    try:
        drafter = llm.engine.executor.runner.drafter
        graph = drafter.graph
        assert graph is not None and graph.verify_len == 4
        h = drafter.hf_config.hidden_size
        rng, g = random.Random(0), torch.Generator().manual_seed(0)
        free = list(range(1, 64))
        for counts in ([1, 3, 4], [1, 1]):  # a feed after verification; a one-token step
            starts = [rng.randint(0, 40) for _ in counts]
            seqs = [(s, c, [free.pop() for _ in range(-(-(s + c) // drafter.block_size))])
                    for s, c in zip(starts, counts, strict=True)]  # fmt: skip
            ids = [rng.randrange(3, 300) for _ in range(sum(counts))]
            positions = [p for s, c, _ in seqs for p in range(s, s + c)]
            features = torch.randn(len(ids), h, generator=g)
            with torch.inference_mode():
                got = drafter._forward_head(ids, features, positions, seqs)
                common = common_metadata_from_seqs(seqs, drafter.block_size)
                step = StepInputs(ids, positions, common)
                step.intermediate = IntermediateTensors(features, None)
                want = run_step(None, drafter.step_module, step, drafter._eager_inputs)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            other = torch.randn(len(ids), h, generator=g)  # the features matter
            with torch.inference_mode():
                moved = drafter._forward_head(ids, other, positions, seqs)
            assert not torch.allclose(moved[0], got[0], atol=1e-3)
        assert graph.verify_runs == {4: 2} and graph.runs == {2: 2}
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs", CASES, ids=["plain", "preempt-chunked"])
def test_random_head_greedy_identical(tiny_llama_dir, random_head, kwargs):
    waves = _waves(tiny_llama_dir)
    ref, _, _, _, _ = generate_greedy(tiny_llama_dir, None, waves, **kwargs)
    spec = {"method": "eagle3", "model": str(random_head), "num_speculative_tokens": 2}
    spec["draft_backoff"] = False  # draft at every step
    got, stats, hits, leaked, _ = generate_greedy(tiny_llama_dir, spec, waves, **kwargs)
    assert got == ref and leaked == 0 and hits > 0
    assert stats.num_draft_tokens > 0


@pytest.mark.parametrize("layers", [None, [0, 2]])
def test_target_hands_the_head_hf_hidden_states(tiny_llama_dir, layers):
    """The residual stream entering each aux layer, as vLLM numbers them, is HF's
    output_hidden_states[i] (i = 0: the embeddings); the default is (2, L // 2, L - 3)."""
    from transformers import AutoModelForCausalLM

    from engine.attention.backends.torch import TorchAttentionBackend
    from engine.attention.metadata import common_metadata_from_seqs
    from engine.models.loader import load_model

    raw = {} if layers is None else {"eagle_aux_hidden_state_layer_ids": layers}
    ids = aux_layer_ids(raw, 3)
    assert ids == ([0, 1, 2] if layers is None else layers)
    model = load_model(tiny_llama_dir, dtype="float32", device="cpu")
    cfg = model.config
    block = 8
    backend = TorchAttentionBackend(
        block, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, torch.float32
    )
    for attn in model.attention_layers():
        attn.backend = backend
        attn.kv_cache = torch.zeros(2, 4, block, cfg.num_key_value_heads, cfg.head_dim)
    model.model.aux_hidden_layers = frozenset(ids)
    tokens = list(range(5, 24))
    meta = backend.build_metadata(common_metadata_from_seqs([(0, len(tokens), [1, 2, 3])], block))
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(len(tokens)), meta)
    got = model.model.aux_hidden_states
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    assert len(got) == len(ids)
    for i, state in zip(ids, got, strict=True):
        torch.testing.assert_close(state, want[i][0], rtol=1e-4, atol=1e-4)
    # and layer i's input differs from its neighbours' (the check can tell layers apart)
    assert not torch.allclose(want[0][0], want[2][0], atol=1e-2)


def test_aux_layer_ids_refusals():
    with pytest.raises(ValueError, match="default layers"):
        aux_layer_ids({}, 2)  # (2, 1, -1)
    with pytest.raises(ValueError, match="distinct layer ids"):
        aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, 8)
    with pytest.raises(ValueError, match="0 to 7"):
        aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}}, 8)
    assert aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [7, 1, 4]}, 8) == [1, 4, 7]


def test_refusals(tiny_llama_dir, random_head, tmp_path):
    def engine(head):
        return LLM(
            str(tiny_llama_dir),
            dtype="float32",
            speculative_config={"method": "eagle3", "model": str(head)},
        )

    wide = tmp_path / "wide"
    shutil.copytree(random_head, wide)
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**cfg, "target_hidden_size": 128}))
    with pytest.raises(ValueError, match="hidden states of size 128"):
        engine(wide)
    odd = tmp_path / "odd"
    shutil.copytree(random_head, odd)
    edit_weights(odd, lambda t: {**t, "layers.1.mlp.down_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        engine(odd)
    no_map = tmp_path / "no-map"
    shutil.copytree(random_head, no_map)
    edit_weights(no_map, lambda t: {k: v for k, v in t.items() if k != "d2t"})
    with pytest.raises(ValueError, match="no d2t map"):
        engine(no_map)
    narrow_fc = tmp_path / "narrow-fc"
    shutil.copytree(random_head, narrow_fc)
    edit_weights(narrow_fc, lambda t: {**t, "fc.weight": t["fc.weight"][:, :128]})
    with pytest.raises(ValueError, match="fc.weight"):
        engine(narrow_fc)


def test_runner_feeds_the_head_the_configured_layers(tiny_llama_dir, tmp_path):
    """End to end: with eagle_aux_hidden_state_layer_ids [0, 2] the runner's prefill step
    hands the head HF's hidden_states[0] and [2] side by side, and fc is 2H wide."""
    from transformers import AutoModelForCausalLM

    head = eagle3_head(tiny_llama_dir, tmp_path / "head", mirror=False, aux_layers=[2, 0])
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        speculative_config={"method": "eagle3", "model": str(head)},
        async_scheduling=False,
    )
    try:
        runner = llm.engine.executor.runner
        drafter = runner.drafter
        assert runner.model.model.aux_hidden_layers == {0, 2}
        assert tuple(drafter.model.fc.weight.shape) == (64, 128)
        seen = []
        read = drafter.step_features
        drafter.step_features = lambda hidden: seen.append(read(hidden)) or seen[-1]
        prompt = list(range(5, 26))
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(
        seen[0], torch.cat((want[0][0], want[2][0]), dim=-1), rtol=1e-4, atol=1e-4
    )
