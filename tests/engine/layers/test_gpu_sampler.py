"""The GPU sampler (engine.layers.gpu_sampler) on CPU tensors: greedy and the logit changes
exactly as the CPU sampler, draws from the reference distribution, seeded draws independent
of the batch, the counter-based uniforms; the persistent parameter tables of the input batch;
the runner's wiring of it, end to end."""

from __future__ import annotations

import pytest
import torch

from engine.layers import gpu_sampler
from engine.layers.gpu_sampler import GpuSampler, hash_uniforms, splitmix64
from engine.layers.sampler import Sampler
from engine.layers.sampler import _apply_changes as cpu_apply_changes
from engine.outputs import NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import CachedRequestState, InputBatch, SamplingTensors


def req(rid, out=(), prompt=(1, 2, 3), num_samples=1, eos=None, **params) -> CachedRequestState:
    state = CachedRequestState.from_new(
        NewRequestData(str(rid), list(prompt), SamplingParams(**params), list(out), eos)
    )
    state.num_samples = num_samples
    return state


def gpu_sample(logits, reqs, sampler: GpuSampler | None = None, seed: int = 0):
    """Tokens for reqs from a GPU sampler over CPU tensors (a fresh one unless given)."""
    if sampler is None:
        sampler = GpuSampler(SamplingTensors("cpu"), seed=seed)
    params = sampler.params
    for r in reqs:
        if r.request_id not in params.column:
            params.add(r.request_id, r.sampling_params)
    params.flush()
    rows = sampler.stage(
        list(range(len(reqs))),
        [params.column[r.request_id] for r in reqs],
        [len(r.output_token_ids) for r in reqs],
    )
    return sampler.sample(logits, reqs, rows).tolist()


def reference_probs(row: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float):
    """vLLM's semantics the slow way (as in test_sampler.py)."""
    p = torch.softmax(row.double() / t, -1)
    if min_p:
        p[p < min_p * p.max()] = 0
    vals, idx = p.sort(descending=True)
    if top_k:
        vals[top_k:] = 0
    vals /= vals.sum()
    if top_p < 1:
        vals[vals.cumsum(0) - vals >= top_p] = 0
        vals /= vals.sum()
    return torch.zeros_like(p).index_put_((idx,), vals)


def frequencies(row: torch.Tensor, n: int, **params) -> torch.Tensor:
    logits = row.expand(4, -1).contiguous()
    reqs = [req(i, num_samples=n // 4, **params) for i in range(4)]
    tokens = gpu_sample(logits, reqs)
    counts = torch.bincount(torch.tensor(sum(tokens, [])), minlength=row.numel())
    return counts.double() / n


def _changing_requests():
    return [
        req(0, temperature=0.0),
        req(1, temperature=0.0, logit_bias={5: 3.0, 17: -2.0}),
        req(2, temperature=0.0, repetition_penalty=1.4, out=[3, 3, 8], prompt=[8, 40, 41]),
        req(3, temperature=0.0, presence_penalty=0.7, frequency_penalty=0.3, out=[1, 1, 1, 60]),
        req(4, temperature=0.0, min_tokens=3, eos=2, stop_token_ids=[9], out=[4]),
        req(5, temperature=0.0, repetition_penalty=0.8, presence_penalty=-0.5, out=[70]),
    ]


def test_logit_changes_equal_the_cpu_samplers() -> None:
    reqs = _changing_requests()
    logits = torch.randn(len(reqs), 300, generator=torch.Generator().manual_seed(0)) * 3
    cpu, gpu = logits.clone(), logits.clone()
    cpu_apply_changes(cpu, reqs)
    params = SamplingTensors("cpu")
    for r in reqs:
        params.add(r.request_id, r.sampling_params)
    params.flush()
    cols = torch.tensor([params.column[r.request_id] for r in reqs])
    gpu_sampler._apply_changes(gpu, reqs, params.floats.index_select(1, cols))
    assert torch.equal(gpu, cpu)


def test_greedy_rows_equal_the_cpu_sampler() -> None:
    reqs = _changing_requests()
    logits = torch.randn(len(reqs), 5000, generator=torch.Generator().manual_seed(1))
    assert gpu_sample(logits.clone(), reqs) == Sampler()(logits.clone(), reqs)[0]
    plain = [req(i, temperature=0.0) for i in range(4)]
    assert gpu_sample(logits[:4].clone(), plain) == [[t] for t in logits[:4].argmax(-1).tolist()]


def test_temperature_follows_softmax() -> None:
    row = torch.tensor([1.0, 0.5, 0.0, -1.0])
    for t in (0.5, 1.0, 1.7):
        freq = frequencies(row, 4000, temperature=t)
        expected = torch.softmax(row.double() / t, -1)
        assert (freq - expected).abs().max() < 0.03, (t, freq, expected)


@pytest.mark.parametrize(
    "t, top_k, top_p, min_p",
    [(1.0, 2, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.7, 0, 1.0, 0.3), (1.0, 3, 0.7, 0.0)],
)
def test_truncation_distribution(t, top_k, top_p, min_p) -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, -3.0])
    freq = frequencies(row, 4000, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = reference_probs(row, t, top_k, top_p, min_p)
    assert torch.all(freq[expected == 0] == 0)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


@pytest.mark.parametrize("top_k, top_p", [(40, 1.0), (0, 0.5), (100, 0.9)])
def test_large_vocab_truncation_stays_in_the_kept_set(top_k, top_p) -> None:
    row = torch.randn(20000, generator=torch.Generator().manual_seed(4)) * 4
    expected = reference_probs(row, 1.0, top_k, top_p, 0.0)
    freq = frequencies(row, 2000, temperature=1.0, top_k=top_k, top_p=top_p)
    assert torch.all(freq[expected == 0] == 0)
    assert expected[freq > 0].sum() > 0.5


def test_mixed_batch_greedy_rows_unaffected() -> None:
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(2))
    reqs = [req(0, temperature=0.0), req(1, temperature=1.0), req(2, temperature=0.0)]
    reqs.append(req(3, temperature=1.0, top_k=5, num_samples=2))
    tokens = gpu_sample(logits.clone(), reqs)
    assert tokens[0] == [int(logits[0].argmax())] and tokens[2] == [int(logits[2].argmax())]
    assert len(tokens[3]) == 2 and set(tokens[3]) <= set(logits[3].topk(5).indices.tolist())


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    """Same seed and output count -> same tokens, alone or among others, at any row; another
    output count or seed -> another draw."""
    row = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    alone = gpu_sample(row[None].clone(), [req("a", seed=42, num_samples=4, out=[1, 2])])
    others = torch.randn(3, 3000, generator=torch.Generator().manual_seed(9))
    batch = torch.cat([others[:2], row[None], others[2:]])
    reqs = [req("x", seed=1), req("y"), req("b", seed=42, num_samples=4, out=[1, 2])]
    reqs.append(req("z", top_p=0.5))
    assert gpu_sample(batch, reqs, seed=5)[2] == alone[0]
    later = gpu_sample(row[None].clone(), [req("a", seed=42, num_samples=4, out=[1, 2, 3])])
    other_seed = gpu_sample(row[None].clone(), [req("a", seed=43, num_samples=4, out=[1, 2])])
    assert later != alone and other_seed != alone
    assert len(set(alone[0])) > 1  # the four samples are separate draws


def test_unseeded_draws_change_from_step_to_step() -> None:
    sampler = GpuSampler(SamplingTensors("cpu"), seed=0)
    logits = torch.zeros(1, 5000)  # uniform
    draws = [gpu_sample(logits, [req("u")], sampler)[0][0] for _ in range(5)]
    assert len(set(draws)) > 1


def test_logits_stay_raw_where_logprobs_are_asked() -> None:
    logits = torch.randn(2, 200, generator=torch.Generator().manual_seed(5))
    raw = logits.clone()
    reqs = [req(0, logit_bias={3: 10.0}, logprobs=2, temperature=0.0), req(1, temperature=0.0)]
    tokens = gpu_sample(logits, reqs)
    assert torch.equal(logits, raw) and tokens[0] == [3]
    sampler = GpuSampler(SamplingTensors("cpu"))
    lps = sampler.logprobs(logits, reqs, tokens)
    assert lps[1] is None and lps[0][0].token_id == 3
    expect = torch.log_softmax(raw[0].double(), -1)[3].item()
    assert lps[0][0].logprob == pytest.approx(expect, abs=1e-4)


def _splitmix_reference(z: int) -> int:
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_splitmix64_wraps_like_c() -> None:
    values = [0, 1, 42, -1, -(1 << 63), (1 << 63) - 1, 0x123456789ABCDEF, -987654321]
    got = splitmix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_splitmix_reference(v) for v in values]


def test_hash_uniforms() -> None:
    keys = torch.arange(2000, dtype=torch.int64)
    u = hash_uniforms(keys, torch.zeros_like(keys), 8)
    assert u.dtype == torch.float64 and u.shape == (2000, 8)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert torch.equal(u[5], hash_uniforms(keys[5:6], torch.zeros(1, dtype=torch.int64), 8)[0])


def test_sampling_tensors_columns() -> None:
    params = SamplingTensors("cpu", capacity=2)
    params.add("a", SamplingParams(temperature=0.5, top_k=7, seed=9))
    params.add("b", SamplingParams(top_p=0.3, presence_penalty=0.2))
    params.add("c", SamplingParams(min_p=0.1, seed=-3))  # full: the tables double
    assert params.capacity == 4 and sorted(params.column.values()) == [0, 1, 2]
    params.remove("b")
    params.remove("never-added")
    params.add("d", SamplingParams(frequency_penalty=1.5))
    assert params.column["d"] == 1  # the freed column
    params.flush()
    cols = [params.column[r] for r in "acd"]
    f, i = params.floats[:, cols], params.ints[:, cols]
    assert f[0].tolist() == pytest.approx([0.5, 1.0, 1.0])
    assert f[2].tolist() == pytest.approx([0.0, 0.1, 0.0])
    assert f[5].tolist() == pytest.approx([0.0, 0.0, 1.5])
    assert i[0].tolist() == [7, 0, 0]
    assert i[1].tolist() == [9, -3 & 0x7FFFFFFFFFFFFFFF, -1]


def test_input_batch_keeps_the_columns_in_step() -> None:
    batch = InputBatch(SamplingTensors("cpu"))
    new = [NewRequestData(r, [1, 2], SamplingParams(temperature=0.3), [], None) for r in "ab"]
    batch.update(SchedulerOutput(scheduled=[], num_batched_tokens=0, new_requests=new))
    assert set(batch.sampling.column) == {"a", "b"}
    col = batch.sampling.column["a"]
    assert batch.sampling.floats[0, col].item() == pytest.approx(0.3)
    batch.update(
        SchedulerOutput(
            scheduled=[], num_batched_tokens=0, finished_request_ids=["a"],
            preempted_request_ids=["b"],
        )
    )  # fmt: skip
    assert batch.sampling.column == {}


def test_the_runner_samples_through_the_gpu_sampler(tiny_llama_dir) -> None:
    """The runner's device sampling path (on the CPU here): greedy output as the CPU
    sampler's; seeded sampling the same with other requests around it."""
    from engine import LLM

    prompts = [list(range(10 + 7 * i, 25 + 9 * i)) for i in range(3)]
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=96, max_num_seqs=8)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    runner = llm.engine.executor.runner
    params = SamplingTensors("cpu")
    runner.input_batch = InputBatch(params)  # between requests: the batch is empty
    runner.gpu_sampler = GpuSampler(params)
    dev = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    among = llm.generate([prompts[1], prompts[0]], [greedy, seeded], use_tqdm=False)
    llm.shutdown()
    assert dev == cpu
    assert among[1].outputs[0].token_ids == alone and len(alone) == 8
