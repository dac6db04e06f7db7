"""Chat templates that render tools the way Mistral and the pythonic (Llama 3.2 / 4) models
do, and the replies a tiny model learns for them (tool_model.build_tool_model): a call with
text before it, two calls, and a text answer.

The Mistral one refuses call ids that are not 9 letters and digits, as Mistral's own
templates do, and writes its markers as special tokens; the v0.3 list form and the newer
name[ARGS] form are both learned.
"""

from __future__ import annotations

import json

from tests.api.openai.tools.tool_model import PARIS, ROME

_CHECK_ID = (
    "{% if id is not string or id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}"
)

# Tools as `name(argument, ...)` lines, not their whole JSON as the real templates write them:
# the prompts stay short, and so does training the model (a few hundred steps over them).
_TOOL_LINES = (
    "{% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters.properties | join(', ') }})\n{% endfor %}"
)

MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]" + _TOOL_LINES + "[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS]["
    "{%- for tc in message.tool_calls %}{% set id = tc.id %}" + _CHECK_ID + '{"name": "'
    '{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": '
    '"{{ id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}'
    "{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{%- elif message.role == 'tool' %}{% set id = message.tool_call_id %}"
    + _CHECK_ID
    + '[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ id }}"}'
    "[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}{%- endif %}{%- endfor %}"
)
MISTRAL_SPECIAL_TOKENS = (
    "[TOOL_CALLS]",
    "[ARGS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[INST]",
    "[/INST]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)

PYTHONIC_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call these functions:\n"
    + _TOOL_LINES
    + "Call them as [name(argument=value), ...].<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n["
    "{%- for tc in message.tool_calls %}{{ tc.function.name }}("
    "{%- for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{%- if not loop.last %}, {% endif %}{% endfor %})"
    "{%- if not loop.last %}, {% endif %}{% endfor %}]<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>ipython\n{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _py(name: str, args: dict) -> str:
    return name + "(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) + ")"


WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
PARALLEL_Q = [{"role": "user", "content": "Weather in Paris and Rome?"}]
HELLO_Q = [{"role": "user", "content": "Say hello."}]
HELLO = "Hello! How can I help?"

# style -> (template, special tokens, {name: (messages, learned reply)}, text before the call)
STYLES = {
    "mistral": (
        MISTRAL_TEMPLATE,
        MISTRAL_SPECIAL_TOKENS,
        {
            "weather": (
                WEATHER_Q,
                "Let me check.[TOOL_CALLS]"
                + json.dumps([{"name": "get_weather", "arguments": PARIS}]),
            ),
            "parallel": (
                PARALLEL_Q,
                f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(PARIS)}"
                f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(ROME)}",
            ),
            "hello": (HELLO_Q, HELLO),
        },
        "Let me check.",
    ),
    "pythonic": (
        PYTHONIC_TEMPLATE,
        (),
        {
            "weather": (WEATHER_Q, "Let me check. [" + _py("get_weather", PARIS) + "]"),
            "parallel": (
                PARALLEL_Q,
                f"[{_py('get_weather', PARIS)}, {_py('get_weather', ROME)}]",
            ),
            "hello": (HELLO_Q, HELLO),
        },
        "Let me check. ",
    ),
}
