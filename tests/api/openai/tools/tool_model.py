"""A tiny model that really calls tools: a Qwen2-style (Hermes) chat template, and weights
trained for a few seconds until greedy decoding reproduces a handful of replies exactly.

A random model never writes <tool_call>; this one does, so the server's parsing, streaming
and finish reasons are tested on real generated tokens. The replies it learned (for the
prompts rendered with TOOLS) are in REPLIES; the conversations in CONVERSATIONS.
"""

from __future__ import annotations

import json
from pathlib import Path

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool.function | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content }}{% for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]

PARIS = {"city": "Paris", "unit": "C"}
ROME = {"city": "Rome", "unit": "F"}


def _call(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def _history_call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


JSON_GREETING = '{"greeting":"hello"}'  # compact: the JSON grammar's separators
ROUND_TRIP = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_history_call("call_1", "get_weather", PARIS)],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
# name -> (messages, the reply learned for them when rendered with TOOLS)
CONVERSATIONS = {
    "weather": (
        [{"role": "user", "content": "What is the weather in Paris?"}],
        "Let me check.\n" + _call("get_weather", PARIS),
    ),
    "parallel": (
        [{"role": "user", "content": "Weather in Paris and Rome?"}],
        _call("get_weather", PARIS) + "\n" + _call("get_weather", ROME),
    ),
    "hello": ([{"role": "user", "content": "Say hello."}], "Hello! How can I help?"),
    "round_trip": (ROUND_TRIP, "It is 21 C in Paris."),
    # the same round trip as the server renders it when the first turn said something before
    # its call (a stored conversation's history: previous_response_id)
    "round_trip_after_text": (
        [ROUND_TRIP[0], {**ROUND_TRIP[1], "content": "Let me check.\n"}, ROUND_TRIP[2]],
        "It is 21 C in Paris.",
    ),
    # a reply that is a JSON object: what a json_object format must let through unchanged
    "json": ([{"role": "user", "content": "Greet me in JSON."}], JSON_GREETING),
}


def _template_messages(messages: list[dict]) -> list[dict]:
    """What the server hands the template: content None -> "", arguments as objects."""
    return [{**m, "content": m.get("content") or ""} for m in messages]


def build_tool_model(
    out_dir: Path,
    template: str = HERMES_TEMPLATE,
    conversations: dict[str, tuple[list[dict], str]] = CONVERSATIONS,
    special_tokens: tuple[str, ...] = (),
) -> Path:
    """Train the model on `conversations` rendered with `template` (default: the Hermes
    ones); `special_tokens` are whole special tokens of the format (Mistral's markers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tokenizer import Tokenizer
    from tests.conftest import _CORPUS, build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = list(_CORPUS) + [template, json.dumps(TOOLS)]
    corpus += [r for _, r in conversations.values()]
    corpus += [m["content"] or "" for msgs, _ in conversations.values() for m in msgs]
    fast = build_tokenizer(out_dir, vocab_size=512, corpus=corpus, chat_template=template)
    if special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
        fast.save_pretrained(str(out_dir))
    tok = Tokenizer.from_pretrained(out_dir)
    eos = tok.eos_token_id
    sequences = []
    for messages, reply in conversations.values():
        prompt = tok.apply_chat_template(_template_messages(messages), tools=TOOLS)
        target = tok.encode(reply, add_special_tokens=False) + [eos]
        sequences.append((prompt, target))
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for step in range(300):
        loss = 0.0
        for prompt, target in sequences:
            ids = torch.tensor([prompt + target])
            labels = torch.tensor([[-100] * len(prompt) + target])
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9 and _memorised(model, sequences):
            break
    model.eval()
    model.config.trained_steps = step + 1  # for the record in config.json
    assert _memorised(model, sequences), "the tool model did not learn its replies"
    model.save_pretrained(str(out_dir))
    return out_dir


def _memorised(model, sequences) -> bool:
    import torch

    with torch.no_grad():
        for prompt, target in sequences:
            ids = torch.tensor([prompt + target])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            margin = logits.topk(2).values
            if logits.argmax(-1).tolist() != target or (margin[:, 0] - margin[:, 1]).min() < 0.5:
                return False
    return True
