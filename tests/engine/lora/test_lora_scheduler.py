"""The scheduler mixes at most max_loras adapters a step: requests of another adapter wait,
the others (and the base model's) run past them; a request's adapter is in its block hashes."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig
from engine.core.kv_cache_utils import extend_block_hashes
from engine.core.scheduler import Scheduler
from engine.lora.request import LoRARequest
from engine.outputs import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", start=1))


def _scheduler(max_loras: int | None) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128, max_loras=max_loras
    )
    return Scheduler(config, CacheConfig(block_size=16), num_blocks=64)


def _request(rid: str, lora: LoRARequest | None, max_tokens: int = 3) -> Request:
    return Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), lora_request=lora)


def _step(s: Scheduler) -> list[str]:
    out = s.schedule()
    s.update_from_output(
        out, ModelRunnerOutput({r.request_id: [7] if r.sample else [] for r in out.scheduled})
    )
    return [r.request_id for r in out.scheduled]


def test_other_adapters_wait_without_stalling_the_rest():
    s = _scheduler(max_loras=2)
    for rid, lora in [("a1", A), ("b1", B), ("c1", C), ("base", None), ("a2", A), ("c2", C)]:
        s.add_request(_request(rid, lora))
    # c1 has no slot: a1, b1, the base request and a2 (adapter a is resident) run past it
    assert _step(s) == ["a1", "b1", "base", "a2"]
    assert [r.request_id for r in s.waiting] == ["c1", "c2"]  # in their order
    _step(s)
    _step(s)  # max_tokens 3: the first four finish, then c's requests get a slot
    assert _step(s) == ["c1", "c2"]


def test_every_step_stays_within_max_loras():
    s = _scheduler(max_loras=1)
    loras = [A, B, None, C, A, B]
    for i, lora in enumerate(loras):
        s.add_request(_request(f"r{i}", lora, max_tokens=2 + i))
    lora_of = {f"r{i}": lora for i, lora in enumerate(loras)}
    seen = []
    while s.has_unfinished_requests():
        ids = _step(s)
        adapters = {lora_of[r].lora_int_id for r in ids if lora_of[r] is not None}
        assert len(adapters) <= 1
        seen += ids
    assert set(seen) == set(lora_of)


def test_without_lora_nothing_is_held_back():
    s = _scheduler(max_loras=None)
    for rid, lora in [("a1", A), ("b1", B), ("c1", C)]:
        s.add_request(_request(rid, lora))
    assert _step(s) == ["a1", "b1", "c1"]


def test_block_hashes_differ_per_adapter_and_from_the_base():
    tokens = list(range(40))

    def hashes(lora, salt=None):
        r = Request("r", tokens, SamplingParams(), lora_request=lora, cache_salt=salt)
        extend_block_hashes(r, 16)
        return r.block_hashes

    base, a, b = hashes(None), hashes(A), hashes(B)
    assert len(base) == 2
    assert not ({*base} & {*a}) and not ({*a} & {*b}) and not ({*base} & {*b})
    assert hashes(A) == a  # stable
    same_name_other_id = LoRARequest("a", 9, "/adapters/a")
    assert hashes(same_name_other_id)[0] != a[0]
    assert hashes(A, salt="t1")[0] not in (a[0], hashes(None, salt="t1")[0])
