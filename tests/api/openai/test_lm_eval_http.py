"""lm-evaluation-harness (PyPI `lm-eval`) against a real server on loopback: its
`local-completions` model runs a tiny multiple-choice task (a local JSONL, no download), so
every request is its loglikelihood shape (token-id prompts, echo, logprobs 1, max_tokens 1);
each example's loglikelihoods equal the offline engine's prompt logprobs on the same tokens."""

from __future__ import annotations

import json
import math

import pytest

from engine import LLM, SamplingParams

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
MODEL = "tiny"
DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Cats like to", "choices": [" sleep", " fly", " swim"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
]
TASK = """\
task: tessera_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(tiny_llama_dir, "--served-model-name", MODEL, "--api-key", KEY)


def test_lm_eval_loglikelihood_task_matches_offline(server, tiny_llama_dir, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tessera_tiny_mc.yaml").write_text(TASK.format(data=data))

    lm = LocalCompletionsAPI(
        model=MODEL,
        base_url=server.base_url + "/v1/completions",
        tokenizer=str(tiny_llama_dir),
        tokenizer_backend="huggingface",
        batch_size=2,  # two prompts a request: a list of token-id prompts
        max_retries=1,
        max_length=512,
    )
    results = simple_evaluate(
        model=lm,
        tasks=["tessera_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        limit=None,
        cache_requests=False,
    )
    assert 0.0 <= results["results"]["tessera_tiny_mc"]["acc,none"] <= 1.0
    samples = results["samples"]["tessera_tiny_mc"]
    assert len(samples) == len(DOCS)

    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_model_len=512)
    try:
        for sample in samples:
            pairs = [tuple(a) for a in sample["arguments"]]
            got = [r[0] for r in sample["resps"]]
            assert len(pairs) == len(got) == len(sample["doc"]["choices"])
            for (context, continuation), (ll, is_greedy) in zip(pairs, got, strict=True):
                ctx, cont = lm._encode_pair(context, continuation)
                out = llm.generate(
                    [ctx + cont],
                    SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                    use_tqdm=False,
                )[0]
                entries = out.prompt_logprobs[len(ctx) :]
                want = sum(e.logprob for e in entries)
                assert math.isclose(ll, want, abs_tol=1e-3), (context, continuation, ll, want)
                assert is_greedy == all(e.rank == 1 for e in entries)
    finally:
        llm.shutdown()
