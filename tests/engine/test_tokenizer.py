"""Tokenizer and IncrementalDetokenizer against a small byte-level BPE built offline."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import CHATML_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

SENTENCES = [
    "Hello world, this is a test.",
    "Un café à Paris, s'il vous plaît.",
    "日本語のテキストです。東京は大きい。",
    "Emoji 😀🚀 and more 🎉! Ünïcödé façade naïve.",
    "The quick brown fox jumps over the lazy dog.",
]


def _build(path, chat_template: str | None) -> Tokenizer:
    build_tokenizer(
        path, 400, corpus=SENTENCES, chat_template=chat_template, bos_token="<|endoftext|>"
    )
    return Tokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return _build(tmp_path_factory.mktemp("tok"), CHATML_TEMPLATE)


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    deltas = [detok.update(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.finish()]


def test_basic_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == len(tok.hf)
    assert tok.eos_token_id == tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.bos_token_id == tok.hf.convert_tokens_to_ids("<|endoftext|>")
    assert tok.eos_token_id in tok.all_special_ids
    for s in SENTENCES:
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.decode(ids) == "hi"


def test_from_pretrained_missing_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("stream", [True, False], ids=["rust-stream", "python"])
def test_valid_text_streams_exactly_and_never_splits_a_character(tok: Tokenizer, stream) -> None:
    # The test must exercise splits: some tokens of this text are partial characters.
    text = " ".join(SENTENCES)
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    prompt = tok.encode("Prompt: 日本")
    for chunk in (1, 2, 3):
        detok = IncrementalDetokenizer(tok, prompt, stream=stream)
        deltas = _stream(detok, ids, chunk)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == text == detok.text


@pytest.mark.parametrize("stream", [True, False], ids=["rust-stream", "python"])
def test_random_ids_concatenate_to_full_decode(tok: Tokenizer, stream) -> None:
    rng = random.Random(0)
    special = set(tok.all_special_ids) | {tok.hf.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    ordinary = [i for i in range(tok.vocab_size) if i not in special]
    prompts = [[], tok.encode("Bonjour, café"), tok.encode("<|im_start|>user\n日本<|im_end|>")]
    for trial in range(300):
        n = rng.randint(1, 40)
        ids = [rng.choice(ordinary) if rng.random() > 0.05 else rng.choice(sorted(special))]
        ids += [rng.choice(ordinary) for _ in range(n - 1)]
        skip = trial % 2 == 0
        detok = IncrementalDetokenizer(
            tok, prompts[trial % 3], skip_special_tokens=skip, stream=stream
        )
        deltas = _stream(detok, ids, chunk=1 + trial % 3)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == detok.text


def test_the_rust_stream_gives_the_python_paths_deltas(tok: Tokenizer) -> None:
    """Token for token the same deltas (not only the same whole text), whatever the prompt,
    skip_special_tokens and the split characters; and a stream that fails mid-output hands
    over to the Python path with nothing lost or repeated."""
    rng = random.Random(1)
    special = sorted(set(tok.all_special_ids))
    ordinary = [i for i in range(tok.vocab_size) if i not in special]
    text_ids = tok.encode(" ".join(SENTENCES))
    prompts = [[], tok.encode("Prompt: 日本"), tok.encode("<|im_start|>user\n日本<|im_end|>")]
    for trial in range(200):
        ids = text_ids if trial % 4 == 0 else [rng.choice(ordinary) for _ in range(30)]
        if trial % 5 == 1:
            ids = [*ids[:10], rng.choice(special), *ids[10:]]
        prompt, skip = prompts[trial % 3], trial % 2 == 0
        runs = [
            _stream(IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stream=s), ids)
            for s in (True, False)
        ]
        assert runs[0] == runs[1]
        broken = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = [broken.update([i]) for i in ids[:12]]
        broken._stream = object()  # its next step raises: the Python path takes over
        deltas += [broken.update([i]) for i in ids[12:]] + [broken.finish()]
        assert deltas == runs[1]


@pytest.mark.parametrize("stream", [True, False], ids=["rust-stream", "python"])
def test_decode_window_stays_small(tok: Tokenizer, stream) -> None:
    class Recording(Tokenizer):
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Recording.longest = max(Recording.longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    rec = Recording(tok.hf)
    ids = tok.encode(" ".join(SENTENCES) * 20)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(rec, tok.encode("a prompt of several words here"), stream=stream)
    assert "".join(_stream(detok, ids)) == tok.decode(ids)
    assert Recording.longest <= 8  # a few tokens per step, never the whole output


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok: Tokenizer, include: bool) -> None:
    text = "Hello world, this is a test. The quick brown fox jumps."
    ids = tok.encode(text)
    stop = "is a te"  # spans several tokens
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(
        tok, [], stop=["nowhere", stop], include_stop_str_in_output=include
    )
    deltas = []
    for i in ids:
        deltas.append(detok.update([i]))
        if detok.stopped:
            break
    expected = "Hello world, this is a te" if include else "Hello world, this "
    assert detok.stopped and detok.stop_reason == stop
    assert detok.text == expected
    assert "".join(deltas) == expected
    assert detok.update(tok.encode(" more")) == ""  # nothing after the stop
    assert detok.finish() == ""


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["fox", "quick"])
    out = detok.update(tok.encode("The quick brown fox")) + detok.finish()
    assert (out, detok.stop_reason) == ("The ", "quick")


def test_stop_string_hold_back_flushed_on_finish(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["café!"])
    first = detok.update(tok.encode("Un caf"))
    # "caf" could still begin "café!": held back, not streamed.
    assert first == "Un "
    second = detok.update(tok.encode("é"))
    assert second == ""
    assert not detok.stopped
    assert detok.finish() == "café"  # the request ended (e.g. length): flush it
    assert detok.text == "Un café"


def test_hold_back_released_when_no_longer_a_prefix(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["fox!"])
    assert detok.update(tok.encode("the fo")) == "the "
    assert detok.update(tok.encode("g")) == "fog"
    assert detok.finish() == ""


def test_chat_template(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Où est le café ?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nOù est le café ?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == expected
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == expected.removesuffix("<|im_start|>assistant\n")


def test_chat_template_list_of_text_parts(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    a = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    b = tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}], tokenize=False)
    assert a == b


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "must not be empty"),
        ([{"content": "x"}], "role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text"),
        ([{"role": "user", "content": 3}], "string or a list"),
    ],
)
def test_chat_template_bad_messages(tok: Tokenizer, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_missing_chat_template(tmp_path) -> None:
    plain = _build(tmp_path, None)
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


def _sentencepiece_style() -> Tokenizer:
    """A Llama-2-style tokenizer built offline: "▁" for spaces, byte fallback, and a decoder
    that strips the text's first space (so a token's leading space depends on what precedes it)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    rust.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=[f"<0x{i:02X}>" for i in range(256)],
    )  # fmt: skip
    rust.train_from_iterator(SENTENCES, trainer)
    return Tokenizer(
        PreTrainedTokenizerFast(
            tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
    )


@pytest.mark.parametrize("stream", [True, False], ids=["rust-stream", "python"])
def test_the_first_output_token_keeps_its_leading_space(stream) -> None:
    # Decoded alone, "▁Hello" loses its space; after the prompt's last tokens it keeps it.
    tok = _sentencepiece_style()
    prompt = tok.encode("Say hello", add_special_tokens=False)
    out = tok.encode("Hello world 日本", add_special_tokens=False)
    assert not tok.decode(out).startswith(" ")
    detok = IncrementalDetokenizer(tok, prompt, stream=stream)
    deltas = _stream(detok, out)
    assert deltas[0].startswith(" Hello")
    assert "".join(deltas) == " Hello world 日本"
