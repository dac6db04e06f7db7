"""The one-call decode step (engine.models.llama_decode_plan): the same bytes as the modules,
for one to five rows, both KV cache dtypes, with and without biases; the steps it leaves to
the modules; and the switch that turns it off."""

from __future__ import annotations

import pytest

from engine.layers import cpu_w4


def _generate(path, kv_cache_dtype: str, plan: bool, monkeypatch):
    from engine import LLM, SamplingParams

    monkeypatch.setenv("TESSERA_DECODE_PLAN", "1" if plan else "0")
    llm = LLM(
        str(path), dtype="bfloat16", quantization="w4a8", kv_cache_dtype=kv_cache_dtype,
        num_blocks=64, enable_prefix_caching=False,
    )  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, logprobs=3)
    # one prompt, two, then five at once (steps of 1, 2 and 5 decode rows); prefills always
    # run on the modules
    outs = llm.generate([list(range(50, 83))], params, use_tqdm=False)
    outs += llm.generate([list(range(5, 25)), list(range(30, 37))], params, use_tqdm=False)
    five = [list(range(40 + 9 * i, 49 + 9 * i + i)) for i in range(5)]
    outs += llm.generate(five, params, use_tqdm=False)
    plan = llm.engine.executor.runner.model.model._decode_plan
    runs = None if plan is None else dict(plan.runs)
    llm.shutdown()
    return [
        (o.outputs[0].token_ids, [repr(lp) for lp in o.outputs[0].logprobs]) for o in outs
    ], runs


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plan_writes_what_the_modules_write(make_tiny_model, monkeypatch, kv_cache_dtype, arch):
    """Greedy tokens and every logprob equal with and without the plan (qwen2: q/k/v biases)."""
    if not cpu_w4.available():
        pytest.skip("the plan runs the 4-bit kernel: it needs AVX512-VNNI and a C compiler")
    path = make_tiny_model(f"tiny-{arch}-plan", arch=arch, seed=3)
    with_plan, runs = _generate(path, kv_cache_dtype, True, monkeypatch)
    without, no_runs = _generate(path, kv_cache_dtype, False, monkeypatch)
    assert no_runs is None  # switched off: never built
    assert runs is not None and all(runs.get(rows, 0) > 0 for rows in (1, 2, 5)), runs
    assert with_plan == without
