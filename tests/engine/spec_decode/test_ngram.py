"""NgramProposer (prompt lookup) and the --speculative-config parser."""

from __future__ import annotations

import pytest

from engine.spec_decode import SpeculativeConfig, parse_speculative_config
from engine.spec_decode.ngram import NgramProposer


def proposer(k=3, lo=1, hi=3, **kw):
    return NgramProposer(
        SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi),
        **kw,
    )


def test_longest_ngram_wins():
    # "1 2 3" recurs with 7 8 9 after it; "3" alone recurs earlier with 4 5 6
    tokens = [3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3]
    assert proposer().propose(tokens) == [7, 8, 9]
    assert proposer(hi=1).propose(tokens) == [7, 8, 9]  # latest "3" with 3 tokens after it
    assert proposer(k=2).propose(tokens) == [7, 8]
    assert proposer().propose(tokens, k=1) == [7]


def test_no_match_and_short_histories():
    assert proposer().propose([1, 2, 3, 4]) == []
    assert proposer().propose([5]) == []
    assert proposer(lo=2).propose([1, 2, 9, 2]) == []  # only a 1-gram recurs
    assert proposer().propose([1, 2, 1], k=0) == []


def test_runs_and_truncated_continuations():
    assert proposer().propose([7, 7, 7, 7, 7]) == [7, 7]  # capped by the history's end
    assert proposer().propose([5, 1, 2, 1, 2]) == [1, 2]
    assert proposer().propose([1, 2, 3, 1, 2]) == [3, 1, 2]


def test_lookback_bounds_the_search():
    tokens = [1, 2, 3, 4] + [9] * 50 + [1, 2]
    assert proposer().propose(tokens) == [3, 4, 9]
    assert proposer(lookback=20).propose(tokens) == []


def test_parse_config():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("") is None
    c = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert c == SpeculativeConfig("ngram", 5, 4, 2)
    assert parse_speculative_config({"method": "ngram"}) == SpeculativeConfig()
    assert parse_speculative_config(c) is c
    draft = parse_speculative_config('{"model": "/m/draft", "num_speculative_tokens": 4}')
    assert draft == SpeculativeConfig("draft_model", 4, model="/m/draft")
    assert draft.uses_model and not c.uses_model
    eagle = parse_speculative_config({"method": "eagle", "model": "/m/head"})
    assert eagle == SpeculativeConfig("eagle", 3, model="/m/head") and eagle.uses_model
    eagle3 = parse_speculative_config(
        {"method": "eagle3", "model": "/m/h3", "draft_tensor_parallel_size": 1}
    )
    assert eagle3 == SpeculativeConfig("eagle3", 3, model="/m/h3", draft_tensor_parallel_size=1)


@pytest.mark.parametrize(
    "value,match",
    [
        ('{"method": "mtp", "model": "x"}', "method 'mtp' is not supported yet"),
        ('{"method": "eagle3"}', 'needs "model"'),
        ('{"model": "x", "draft_tensor_parallel_size": 0}', "must be a positive integer"),
        ('{"method": "medusa", "model": "x"}', "Medusa heads are not implemented"),
        ('{"method": "eagle"}', 'needs "model"'),
        ('{"model": "x", "prompt_lookup_max": 2}', "unknown or unsupported"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "ngram", "model": "x"}', "unknown or unsupported"),
        ('{"num_speculative_tokens": 3}', '"method" is required'),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "unknown or unsupported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "must not"),
        ("{nope", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_parse_errors_name_the_field(value, match):
    with pytest.raises(ValueError, match="speculative_config") as e:
        parse_speculative_config(value)
    assert match in str(e.value)


def test_engine_args_flag():
    from engine.args import EngineArgs

    config = EngineArgs(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'
    ).create_engine_config()
    assert config.scheduler.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineArgs().create_engine_config().scheduler.speculative_config is None
    with pytest.raises(ValueError, match="speculative_config"):
        EngineArgs(speculative_config={"method": "medusa"}).create_engine_config()


def _naive(tokens, k, lo, hi):
    """The proposer's rule, spelled out: longest n first; among the earlier occurrences of
    the last n tokens, the latest with k tokens after it, else the earliest."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        pattern = tokens[total - n :]
        starts = [s for s in range(total - n) if tokens[s : s + n] == pattern]
        if starts:
            full = [s for s in starts if s + n + k <= total]
            s = full[-1] if full else starts[0]
            return tokens[s + n : s + n + k]
    return []


def test_matches_the_naive_rule_on_random_histories():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        assert proposer(k, lo, hi).propose(tokens) == _naive(tokens, k, lo, hi), (tokens, k, lo, hi)
