"""Tokenizer (HF fast tokenizer, the model's chat template) and incremental detokenization.

IncrementalDetokenizer follows vLLM's prefix/read offset scheme: each step decodes only a
small window of recent tokens, so a step costs O(1) whatever the output length, and text
that ends in an incomplete UTF-8 character (U+FFFD) is held back until a later token
completes it. The `tokenizers` library's DecodeStream runs that same scheme in Rust (a
quarter of the Python's cost a token: the server detokenizes every token it streams); the
Python path stays for a stream that refuses a step. Stop strings are matched on the
detokenized text and never reach the output.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.stop_matcher import StopMatcher, StopText

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the Python path alone
    DecodeStream = None

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
_PROMPT_WINDOW = 5  # prompt tokens decoded with the first output tokens (leading-space context)


class Tokenizer:
    """A thin wrapper over a HF fast tokenizer: the few calls the engine and the API make."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError("only fast (Rust 'tokenizers') tokenizers are supported")
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer  # the Rust tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)
        self.vocab_size: int = len(hf_tokenizer)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load from a local folder (tokenizer.json etc.); never downloads."""
        if not Path(path).is_dir():
            raise ValueError(f"tokenizer folder {str(path)!r} does not exist")
        # Here, not at the top: AutoTokenizer imports torch (via transformers' configs), which
        # the server's worker processes, unpickling a tokenizer, need not pay for.
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: the longest vocabulary entry
        (special tokens included). A byte-level entry spells one character per byte and a
        SentencePiece one a character per character, so a text of n characters is at least
        n / max_token_chars tokens: a bound the server checks before it tokenizes."""
        return max(1, max(len(t) for t in self.hf.get_vocab()))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The backend directly: no clean_up_tokenization_spaces, so that the text equals what
        # IncrementalDetokenizer streams.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render messages with the model's own template; token ids, or the text.

        A message's content may be a string or a list of {"type": "text", "text": ...} parts
        (joined with newlines, as vLLM does). template_kwargs (tools=..., documents=..., or a
        template's own switches) go to the template as variables.
        """
        if not self.has_chat_template and template_kwargs.get("chat_template") is None:
            raise ValueError(
                "this model's tokenizer has no chat template: use a completion (plain prompt) "
                "instead, or a model whose tokenizer_config.json defines chat_template"
            )
        conversation = [_normalise_message(i, m) for i, m in enumerate(messages)]
        if not conversation:
            raise ValueError("messages must not be empty")
        text = self.hf.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        # The template writes its own special tokens (BOS included): don't add them twice.
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _normalise_message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{i}] must be an object with a 'role'")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}].text must be a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
    return {**message, "content": content}


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, with stop strings.

    update(ids) -> the newly completed text; finish() -> whatever was held back, when the
    request ends for another reason (length, stop token, abort). Stop strings are matched
    incrementally (engine/stop_matcher.py); pass `stop_matcher` to share one automaton
    between the samples of a request.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        stop_matcher: StopMatcher | None = None,
        stream: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Window over the last prompt tokens + the outputs; only its tail is ever decoded.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The Python path's text of ids[prefix_offset:read_offset]; the stream keeps its own,
        # so this one is decoded only when needed (finish, or a fall back to Python).
        self._prefix_text: str | None = None
        self._stream = None
        if stream and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            # The same leading context; a prompt whose tail is still an incomplete character
            # would leave it for the first output token to print: the Python path then.
            try:
                primed = (
                    not self._ids or self._stream.step(tokenizer.backend, self._ids) is not None
                )
            except Exception:  # noqa: BLE001 - a tokenizers without list steps, say: Python
                primed = False
                self._stream = None
            if not primed and self._decode(0, self._read_offset):
                self._stream = None
        if self._stream is None:
            self._prefix_text = self._decode(0, self._read_offset)
        matcher = stop_matcher if stop_matcher is not None else StopMatcher(stop)
        self._out = StopText(matcher, include_stop_str_in_output)
        self.finished = False

    @property
    def text(self) -> str:
        """All output text so far (truncated at a stop string)."""
        return self._out.text

    @property
    def emitted_text(self) -> str:
        """The text the deltas have returned so far: `text` minus any held-back tail."""
        return self._out.emitted_text

    @property
    def stop_reason(self) -> str | None:
        return self._out.stop_reason

    @property
    def stopped(self) -> bool:
        return self._out.stop_reason is not None

    def update(self, new_token_ids: Sequence[int]) -> str:
        if self.finished or self.stopped:
            return ""
        self._out.append("".join([self._step(t) for t in new_token_ids]))
        return self._out.take(hold_back=not self.stopped)

    def finish(self) -> str:
        """Flush the held-back text (an incomplete character, a possible stop-string start)."""
        if self.finished or self.stopped:
            self.finished = True
            return self._out.take(hold_back=False)
        self.finished = True
        full = self._decode(self._prefix_offset, len(self._ids))
        self._out.append(full[len(self._python_prefix()) :])
        return self._out.take(hold_back=False)

    def _python_prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._prefix_text

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _step(self, token_id: int) -> str:
        """vLLM's detokenize_incrementally: decode the window from prefix_offset twice (with
        and without the unread tokens) and return the difference once it is complete."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._tok.backend, token_id)
            except Exception:  # noqa: BLE001 - its prefix changed, say: Python from here on
                self._stream = None
                self._ids.pop()
                return self._step(token_id)
            if delta is None:
                return ""
            self._prefix_text = None  # the stream's window moved as the offsets below do
        else:
            new_text = self._decode(self._prefix_offset, len(self._ids))
            prefix = self._python_prefix()
            if len(new_text) <= len(prefix) or new_text.endswith(_REPLACEMENT):
                return ""  # nothing new yet, or a character still incomplete: wait
            delta = new_text[len(prefix) :]
            self._prefix_text = None
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # Keep the window small: nothing before prefix_offset is ever decoded again.
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself where it is a template."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat_template {value!r}: no such file (nor a Jinja template)")
