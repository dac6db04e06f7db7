"""The scheduler's side of model-based drafts (engine.spec_decode.runner_drafts), with a
fake paged runner whose "draft model" keeps a K/V of its own under the same block ids, fed
as engine.spec_decode.draft_model feeds it: greedy output exact, the draft's K/V holds the
real tokens at every position before each proposal (prefix hits, copies, preemption, rejected
positions), lookahead slots reserved where blocks allow, no block leaked."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_spec_scheduler import VOCAB, SpecRunner, _prompts, copy_model, drive, reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from core_testing import make_request  # noqa: E402

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from engine.spec_decode import SpeculativeConfig  # noqa: E402


class DraftRunner(SpecRunner):
    """SpecRunner plus a fake draft model: after each step it writes the kept tokens (and the
    drafts it feeds itself) into draft_slots and proposes up to k tokens of copy_model,
    wrong now and then (wrong_rng)."""

    def __init__(self, num_blocks, block_size, k, max_model_len, wrong_rng):
        super().__init__(num_blocks, block_size)
        self.k, self.max_model_len, self.wrong_rng = k, max_model_len, wrong_rng
        self.draft_slots: list[int | None] = [None] * (num_blocks * block_size)
        self.num_proposed = 0

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for src, dst in out.blocks_to_copy:  # the draft's cache is copied with the target's
            self.draft_slots[dst * bs : (dst + 1) * bs] = self.draft_slots[
                src * bs : (src + 1) * bs
            ]
        result = super().__call__(out)
        drafts: dict[str, list[int]] = {}
        for sr in out.scheduled:
            state = self.batch[sr.request_id]
            table, tokens = state.block_table, state.token_ids
            capacity = state.num_blocks * bs
            emitted = result.sampled_token_ids.get(sr.request_id)
            if emitted:
                end = sr.start_pos + sr.num_tokens - len(sr.spec_token_ids) + len(emitted)
                end = min(end, len(tokens), capacity)
            else:
                end = sr.start_pos + sr.num_tokens
            for p in range(sr.start_pos, end):
                self.draft_slots[self.slot(table, p)] = tokens[p]
            if not emitted or end != len(tokens):
                continue
            bonus = end - 1
            seen = [self.draft_slots[self.slot(table, p)] for p in range(end)]
            assert seen == tokens, f"{sr.request_id}: the draft's K/V differs from the tokens"
            m = min(self.k, self.max_model_len - 1 - bonus, capacity - bonus)
            history, proposal = list(tokens), []
            for j in range(m):
                t = copy_model(history)
                if self.wrong_rng.random() < 0.3:
                    t = (t + 1) % VOCAB
                proposal.append(t)
                history.append(t)
                if j < m - 1:  # the drafter feeds d_1..d_{m-1} to propose the next
                    self.draft_slots[self.slot(table, bonus + 1 + j)] = t
            if proposal:
                drafts[sr.request_id] = proposal
                self.num_proposed += 1
        result.draft_token_ids = drafts
        return result


def make(num_blocks, budget, k=3, block_size=8, max_model_len=120, caching=True):
    config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        speculative_config=SpeculativeConfig("draft_model", k, model="fake", adaptive=False),
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    return Scheduler(config, cache, num_blocks)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks,budget", [(40, 64), (16, 64), (40, 8)])
def test_greedy_exact_and_draft_kv_in_sync(caching, num_blocks, budget):
    rng = random.Random(num_blocks * 10 + budget)
    prompts = _prompts(rng, 6)
    prompts.append(prompts[0] + [1, 2, 3])  # a prefix hit (when caching)
    requests = [
        make_request(f"r{i}", p, max_tokens=rng.randint(1, 30), temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    longest = max(prompts, key=len)
    late = [make_request("late", longest + [4], max_tokens=12, temperature=0.0)]
    scheduler = make(num_blocks, budget)
    free0 = scheduler.kv_cache_manager.num_free_blocks
    runner = DraftRunner(num_blocks, 8, 3, 120, random.Random(1))
    outputs, _ = drive(scheduler, runner, requests)
    outputs.update(drive(scheduler, runner, late)[0])  # a prefix hit on cached blocks
    for r in [*requests, *late]:
        prompt = list(r.prompt_token_ids)
        assert outputs[r.request_id] == reference(prompt, r.sampling_params.max_tokens)
    stats = scheduler.stats().spec_decoding
    assert runner.num_proposed > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert scheduler.kv_cache_manager.num_free_blocks == free0
    assert len(scheduler.runner_drafts) == 0  # nothing kept for finished requests
    if num_blocks == 16:
        assert scheduler.num_preemptions > 0
    if caching and num_blocks == 40:  # (16 blocks: the cached ones get evicted)
        assert scheduler.kv_cache_manager.prefix_cache_hits > 0


def test_lookahead_slots_and_drafts_dropped_on_preemption():
    """A step that samples reserves k slots past its tokens; drafts wait for the request's
    next decode and are forgotten when it is preempted."""
    scheduler = make(40, 64, k=3)
    scheduler.add_request(make_request("a", list(range(1, 9)), max_tokens=8, temperature=0.0))
    so = scheduler.schedule()
    manager = scheduler.kv_cache_manager
    assert len(manager.req_to_block_ids["a"]) == 2  # 8 tokens + 3 lookahead, blocks of 8
    sampled = ModelRunnerOutput({"a": [20]}, draft_token_ids={"a": [21, 22, 23]})
    scheduler.update_from_output(so, sampled)
    so = scheduler.schedule()
    (sr,) = so.scheduled
    assert sr.spec_token_ids == [21, 22, 23] and sr.num_tokens == 4
    scheduler.update_from_output(so, ModelRunnerOutput({"a": [21, 5]}, draft_token_ids={"a": [6]}))
    request = scheduler.get_request("a")
    assert request.num_computed_tokens == 10  # 8 + the last token + one kept draft
    scheduler._preempt(scheduler.running.pop())
    assert scheduler.runner_drafts.propose("a", 3) == []


def test_drafts_of_a_request_aborted_mid_step_are_not_kept():
    from engine.request import RequestStatus

    scheduler = make(40, 64)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=8, temperature=0.0))
    so = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # while the step ran
    scheduler.update_from_output(so, ModelRunnerOutput({"a": [4]}, draft_token_ids={"a": [5]}))
    assert len(scheduler.runner_drafts) == 0
