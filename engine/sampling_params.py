"""SamplingParams: what a request asks of the sampler and of the stop checks.

Validation raises ValueError with a message that names the parameter and the allowed range,
so the HTTP layer can pass it straight to the client as a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_N = 16  # cap on n: each sample holds its own KV blocks
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
# Stop strings: OpenAI accepts 4; these are generous but bound the automaton a request
# builds (engine/stop_matcher.py) to 64 KiB of characters.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Token-id lists: generous, but they bound what validation walks per request (the range
# check against the vocabulary runs on the caller's thread, the HTTP event loop included).
MAX_LOGIT_BIAS_ENTRIES = 4096
MAX_STOP_TOKEN_IDS = 1024


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names). Exactly one form must be set.

    The engine compiles it into a grammar off the step loop; a request waits for its grammar
    without holding up other requests.
    """

    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / Lark text
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        set_fields = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(set_fields) if set_fields else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema object or JSON text")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("structured_outputs.grammar must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, list)
            and self.choice
            and all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which form is set: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    # None: none; k: each prompt token's logprob given the ones before it, and the top k
    # (vLLM's; the first prompt token has none). Such a request gets no prefix-cache hit.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check(
            isinstance(self.n, int) and 1 <= self.n <= MAX_N,
            f"n must be between 1 and {MAX_N}, got {self.n}",
        )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        _check(
            0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}"
        )
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
            )
        _check(
            len(self.logit_bias or ()) <= MAX_LOGIT_BIAS_ENTRIES,
            f"logit_bias holds {len(self.logit_bias or ())} entries; at most "
            f"{MAX_LOGIT_BIAS_ENTRIES} are allowed",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most "
            f"{MAX_STOP_TOKEN_IDS} are allowed",
        )
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                _check(
                    -100.0 <= bias <= 100.0,
                    f"logit_bias for token {tok} must be in [-100, 100], got {bias}",
                )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty strings",
        )
        longest = max((len(s) for s in self.stop), default=0)
        _check(
            longest <= MAX_STOP_STRING_CHARS,
            f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long, "
            f"got one of {longest}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
