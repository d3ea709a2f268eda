"""Built-in Qwen3.5 / Qwen3.6 chat template (``spec/models.md`` A.9), for checkpoints that ship
without one (``hf_import`` falls back to it; a checkpoint's own ``chat_template.jinja`` wins).

Rendered by ``ChatTemplate`` (transformers-compatible environment). Behaviour:

- content: a string as is; a list of parts -> text parts' text, image / video parts as
  ``<|vision_start|><|image_pad|><|vision_end|>`` / ``...<|video_pad|>...`` (an image or video
  in a system message raises); None -> "".
- ``tools``: one system turn ``# Tools`` with each tool's JSON inside ``<tools>...</tools>``,
  the XML function-call instructions, then the first system message's text; without tools a
  leading system message is its own turn. No default system prompt.
- the last user message whose text is not a ``<tool_response>...</tool_response>`` wrapper is
  the last query (none -> error). Assistant turns after it carry their reasoning as
  ``<think>\\n{reasoning}\\n</think>\\n\\n`` (``reasoning_content``, or the text before
  ``</think>`` in the content); earlier assistant turns drop it unless ``preserve_thinking``.
- assistant ``tool_calls`` -> ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n
  </function>\\n</tool_call>`` (strings raw, mappings / lists as JSON; arguments must be a
  mapping, which ``normalize_messages`` makes of JSON strings).
- consecutive ``tool`` messages share one user turn of ``<tool_response>`` blocks.
- a system message other than the first raises.
- generation prompt: ``<|im_start|>assistant\\n<think>\\n`` (thinking on, the default) or
  ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` when ``enable_thinking`` is false.
"""
from __future__ import annotations

TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
    "\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>")


def _jinja_str(s: str) -> str:
    """``s`` as a jinja string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


QWEN35_CHAT_TEMPLATE = """\
{%- macro text_of(content, in_system=false) -%}
{%- if content is none or content is undefined -%}
{%- elif content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}
{%- if in_system %}{{ raise_exception('System message cannot contain images.') }}{% endif -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif part.type == 'video' or 'video' in part -%}
{%- if in_system %}{{ raise_exception('System message cannot contain videos.') }}{% endif -%}
<|vision_start|><|video_pad|><|vision_end|>
{%- elif 'text' in part -%}{{ part.text }}
{%- else -%}{{ raise_exception('Unexpected item type in content.') }}
{%- endif -%}
{%- endfor -%}
{%- else -%}{{ raise_exception('Unexpected content type.') }}
{%- endif -%}
{%- endmacro -%}
{%- if not messages %}{{ raise_exception('No messages provided.') }}{% endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- set system_text = text_of(messages[0].content, true)|trim if has_system else '' -%}
{%- if tools and tools is iterable and tools is not mapping -%}
<|im_start|>system
{{ TOOLS_PREAMBLE }}
{%- for tool in tools %}{{ '\\n' ~ (tool|tojson) }}{% endfor -%}
{{ '\\n</tools>' ~ TOOLS_INSTRUCTIONS }}
{%- if system_text %}{{ '\\n\\n' ~ system_text }}{% endif -%}
<|im_end|>{{ '\\n' }}
{%- elif has_system -%}
<|im_start|>system{{ '\\n' ~ system_text }}<|im_end|>{{ '\\n' }}
{%- endif -%}
{%- set state = namespace(last_query=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{%- set t = text_of(m.content)|trim -%}
{%- if not (t.startswith('<tool_response>') and t.endswith('</tool_response>')) -%}
{%- set state.last_query = loop.index0 -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if state.last_query < 0 %}{{ raise_exception('No user query found in messages.') }}{% endif -%}
{%- for m in messages -%}
{%- set text = text_of(m.content)|trim -%}
{%- if m.role == 'system' -%}
{%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif -%}
{%- elif m.role == 'user' -%}
<|im_start|>user{{ '\\n' ~ text }}<|im_end|>{{ '\\n' }}
{%- elif m.role == 'assistant' -%}
{%- set thought = '' -%}
{%- if m.reasoning_content is string -%}
{%- set thought = m.reasoning_content -%}
{%- elif '</think>' in text -%}
{%- set thought = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}
{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
<|im_start|>assistant{{ '\\n' }}
{%- if loop.index0 > state.last_query or preserve_thinking|default(false) -%}
<think>{{ '\\n' ~ (thought|trim) ~ '\\n' }}</think>{{ '\\n\\n' }}
{%- endif -%}
{{ text }}
{%- if m.tool_calls and m.tool_calls is iterable and m.tool_calls is not mapping -%}
{%- for call in m.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first %}{{ '\\n' }}{% elif text|trim %}{{ '\\n\\n' }}{% endif -%}
<tool_call>{{ '\\n' }}<function={{ fn.name }}>{{ '\\n' }}
{%- if fn.arguments is defined -%}
{%- for key, value in fn.arguments|items -%}
<parameter={{ key }}>{{ '\\n' }}
{%- if value is mapping or (value is sequence and value is not string) -%}{{ value|tojson }}
{%- else -%}{{ value|string }}
{%- endif -%}
{{ '\\n' }}</parameter>{{ '\\n' }}
{%- endfor -%}
{%- endif -%}
</function>{{ '\\n' }}</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>{{ '\\n' }}
{%- elif m.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif -%}
{{ '\\n' }}<tool_response>{{ '\\n' ~ text ~ '\\n' }}</tool_response>
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif -%}
{%- else -%}{{ raise_exception('Unexpected message role.') }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant{{ '\\n' }}<think>{{ '\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '\\n' }}</think>{{ '\\n\\n' }}{% endif -%}
{%- endif -%}
""".replace("{{ TOOLS_PREAMBLE }}", "{{ " + _jinja_str(TOOLS_PREAMBLE) + " }}").replace(
    "TOOLS_INSTRUCTIONS", _jinja_str(TOOLS_INSTRUCTIONS))
