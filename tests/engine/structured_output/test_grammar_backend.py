"""The llguidance backend, the spec limits and the bitmask, on the tiny test tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.sampling_params import StructuredOutputsParams as S
from engine.structured_output import GrammarError, GrammarLimits, StructuredOutputManager
from engine.structured_output.backend import max_repetition, spec_key
from engine.structured_output.bitmask import apply_token_bitmask, unpack_bitmask


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])
    yield m
    m.shutdown()


def _allowed(manager, matcher) -> set[int]:
    bm = torch.zeros(1, -(-manager.vocab_size // 32), dtype=torch.int32)
    matcher.fill_bitmask(bm, 0)
    return set(unpack_bitmask(bm, manager.vocab_size)[0].nonzero().view(-1).tolist())


def _walk(manager, tokenizer, so, choose) -> str:
    """Generate under the grammar, picking with choose(allowed ids); return the text."""
    m = manager.compile(so).result(timeout=30).matcher()
    out: list[int] = []
    for _ in range(200):
        allowed = _allowed(manager, m)
        assert allowed, "a live grammar always allows some token"
        tok = choose(sorted(allowed))
        assert m.accept_token(tok)
        if tok == tokenizer.eos_token_id:
            break
        out.append(tok)
        if m.is_terminated():
            break
    assert m.is_terminated()
    return tokenizer.decode(out)


@pytest.mark.parametrize(
    "so, check",
    [
        (S(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        (S(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (
            S(
                json={
                    "type": "object",
                    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            ),
            lambda t: 0 <= json.loads(t)["a"] <= 99,
        ),
        (S(grammar='start: "x" NUM\nNUM: /[0-9]{2}/'), lambda t: re.fullmatch(r"x[0-9]{2}", t)),
    ],
)
def test_walks_under_the_mask_match_the_spec(manager, tokenizer, so, check):
    for pick in (lambda a: a[0], lambda a: a[-1], lambda a: a[len(a) // 2]):
        text = _walk(manager, tokenizer, so, pick)
        assert check(text), text


def test_json_object(manager, tokenizer):
    (close,) = tokenizer.encode("}", add_special_tokens=False)
    text = _walk(manager, tokenizer, S(json_object=True), lambda a: close if close in a else a[0])
    assert isinstance(json.loads(text), dict)


def test_a_token_outside_the_mask_ends_the_matcher(manager, tokenizer):
    m = manager.compile(S(regex="[0-9]+")).result(timeout=30).matcher()
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert letter not in _allowed(manager, m)
    assert not m.accept_token(letter)
    assert m.is_terminated()


def test_fork_copies_state(manager, tokenizer):
    m = manager.compile(S(choice=["ab", "cd"])).result(timeout=30).matcher()
    (a,) = tokenizer.encode("a", add_special_tokens=False)[:1]
    child = m.fork()
    assert m.accept_token(a)
    assert _allowed(manager, child) != _allowed(manager, m)  # the child has not moved


@pytest.mark.parametrize(
    "so, words",
    [
        (S(json='{"type": "object"'), "not valid JSON"),
        (S(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
        (S(regex="("), "regex"),
        (S(grammar="start: undefined_rule"), "undefined_rule"),
        (
            S(
                json={
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            ),
            r"\$ref cycle: #/\$defs/a → #/\$defs/b → #/\$defs/a",
        ),
        (S(grammar="start: a\na: b\nb: a"), "grammar matches no output"),
        (S(json={"type": "string", "pattern": "(ab"}), 'invalid regex "\\(ab": unclosed group'),
    ],
)
def test_invalid_specs_raise(manager, so, words):
    with pytest.raises(GrammarError, match=words) as exc:
        manager.compile(so).result(timeout=30)
    assert "<state>" not in str(exc.value) and "<grammar>" not in str(exc.value)


def test_a_recursive_schema_that_makes_progress_compiles(manager, tokenizer):
    """A tree (children: an array of nodes) is recursive but not a cycle: it compiles."""
    node = {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    }
    so = S(json={"$defs": {"node": node}, "$ref": "#/$defs/node"})
    matcher = manager.compile(so).result(timeout=30).matcher()
    (brace,) = tokenizer.encode("{", add_special_tokens=False)[:1]
    assert brace in _allowed(manager, matcher)


def test_limits_refuse_at_once():
    limits = GrammarLimits()
    huge_enum = {"enum": [f"v{i}" for i in range(limits.max_enum_values + 1)]}
    with pytest.raises(GrammarError, match="enum"):
        spec_key(S(json=huge_enum), limits)
    with pytest.raises(GrammarError, match="choices"):
        spec_key(S(choice=[str(i) for i in range(limits.max_enum_values + 1)]), limits)
    with pytest.raises(GrammarError, match="bytes"):
        spec_key(S(regex="a" * (limits.max_spec_bytes + 1)), limits)
    with pytest.raises(GrammarError, match="repeats 40000"):
        spec_key(S(regex="a{200}{200}"), limits)
    with pytest.raises(GrammarError, match="pattern"):
        spec_key(S(json={"type": "string", "pattern": "(x{500}){500}"}), limits)


def test_max_repetition():
    assert max_repetition("a{200}{200}") == 40_000
    assert max_repetition("(a{10}){20}b{3}") == 200
    assert max_repetition(r"\{5\}[{]{9}") == 9
    assert max_repetition("[0-9]+") == 1


def test_compile_cache(manager):
    so = S(regex="[ab]{4}")
    first = manager.compile(so)
    hits = manager.num_cache_hits
    assert manager.compile(S(regex="[ab]{4}")) is first
    assert manager.num_cache_hits == hits + 1
    # dict and JSON text of the same schema share an entry
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}}
    assert manager.compile(S(json=schema)) is manager.compile(S(json=json.dumps(schema)))


def test_bitmask_applies_to_the_given_rows_only():
    torch.manual_seed(0)
    x = torch.randn(4, 70)
    before = x.clone()
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [1, 5, 69]] = True
    allowed[1, 33:40] = True
    words = torch.zeros(2, 3, dtype=torch.int64)
    for r in range(2):
        for t in allowed[r].nonzero().view(-1).tolist():
            words[r, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32)  # wraps bit 31 to the sign, as the engines write it
    apply_token_bitmask(x, torch.tensor([2, 0]), bitmask)
    assert torch.equal(x[1], before[1]) and torch.equal(x[3], before[3])
    for row, r in ((2, 0), (0, 1)):
        assert torch.equal(x[row][allowed[r]], before[row][allowed[r]])
        assert torch.isinf(x[row][~allowed[r]]).all()


def test_check_stop_stop_for_a_completed_grammar_error_for_a_failed_one(manager, tokenizer):
    from engine.core.stop import check_stop
    from engine.request import Request, RequestStatus
    from engine.sampling_params import SamplingParams

    def request(so):
        r = Request("r", [1, 2], SamplingParams(max_tokens=50), eos_token_id=None)
        r.grammar = manager.request_grammar(so)
        r.grammar.future.result(timeout=30)
        return r

    done = request(S(choice=["ab"]))
    for t in tokenizer.encode("ab", add_special_tokens=False):
        done.append_output_token(t)
    assert check_stop(done, 256) and done.status == RequestStatus.FINISHED_STOPPED

    bad = request(S(regex="[0-9]+"))
    bad.append_output_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert check_stop(bad, 256) and bad.status == RequestStatus.FINISHED_ERROR


def test_speculative_drafts_are_cut_to_what_the_grammar_allows(manager, tokenizer):
    """RequestGrammar.valid_drafts: the longest prefix the grammar accepts from the request's
    state (cut at the first token outside the mask, and after the one that completes it),
    the request's own matcher unmoved."""
    g = manager.request_grammar(S(choice=["123-ab"]))
    g.future.result(timeout=30)
    ids = tokenizer.encode("123-ab", add_special_tokens=False)
    assert g.valid_drafts(ids) == ids  # the whole answer: it completes the grammar
    assert g.valid_drafts(ids + ids) == ids  # nothing after completion
    wrong = tokenizer.encode("x", add_special_tokens=False)
    assert g.valid_drafts(ids[:1] + wrong + ids[1:]) == ids[:1]
    assert g.valid_drafts(wrong) == []
    assert g.valid_drafts(ids[:1]) == ids[:1]
    assert _allowed(manager, g.matcher) == _allowed(
        manager, manager.request_grammar(S(choice=["123-ab"])).matcher
    )


def test_a_drafted_request_gets_one_bitmask_row_per_position(manager, tokenizer):
    """start_bitmask with drafts: row j is the mask after the first j drafts (a fresh matcher
    walked there gives the same), beside a plain request's one row; a draft the grammar
    rejects leaves the rows after it at the mask that rejects it."""
    so = S(regex=r"[0-9]{3}-[a-z]{2}")
    ids = tokenizer.encode("123-ab", add_special_tokens=False)
    spec, plain, bad = (manager.request_grammar(so) for _ in range(3))
    for g in (spec, plain, bad):
        g.future.result(timeout=30)
    wrong = tokenizer.encode("x", add_special_tokens=False)
    drafts = ids[:3]
    rows = [("a", spec, drafts), ("b", plain, []), ("c", bad, ids[:1] + wrong)]
    result = manager.start_bitmask(rows)
    assert result.request_ids == ["a"] * 4 + ["b"] + ["c"] * 3
    bitmask = result.result()
    allowed = unpack_bitmask(bitmask, manager.vocab_size)
    for j in range(len(drafts) + 1):
        walker = manager.compile(so).result().matcher()
        for t in drafts[:j]:
            assert walker.accept_token(t)
        assert set(allowed[j].nonzero().view(-1).tolist()) == _allowed(manager, walker)
    assert torch.equal(bitmask[4], bitmask[0])  # the plain request: its state now
    assert torch.equal(bitmask[5], bitmask[0]) and torch.equal(bitmask[6], bitmask[1])
    assert not allowed[6, wrong[0]] and torch.equal(bitmask[7], bitmask[6])
    assert _allowed(manager, spec.matcher) == set(allowed[0].nonzero().view(-1).tolist())
