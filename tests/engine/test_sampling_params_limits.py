"""The token-id list caps of SamplingParams: what validation walks per request is bounded."""

from __future__ import annotations

import pytest

from engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS, SamplingParams


def test_logit_bias_and_stop_token_ids_at_their_caps_are_accepted() -> None:
    bias = {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    params = SamplingParams(logit_bias=bias, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    assert len(params.logit_bias) == MAX_LOGIT_BIAS_ENTRIES


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ],
)
def test_one_over_the_cap_is_refused_naming_the_field(kwargs, field) -> None:
    # The message starts with the field: the HTTP layer takes `param` from it.
    with pytest.raises(ValueError, match=rf"^{field} holds \d+ \w+; at most \d+ are allowed"):
        SamplingParams(**kwargs)
