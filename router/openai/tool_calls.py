"""Tool calling for ``/v1/chat/completions``: the tools into the prompt, ``tool_choice`` into a grammar, and the
model's output back into OpenAI's ``tool_calls``.

    tools + messages -> messages_for_template()    a template that knows tools gets them as ``tools``; one that
                                                    does not (SmolLM2's) gets them described in the system message,
                                                    in the Hermes format most open models are trained on, and the
                                                    conversation's earlier calls and results written the same way
    tool_choice      -> forced_output()            ``required`` / a named function: a JSON schema the output must
                                                    match (engine/structured_output/grammar.py), so the call always
                                                    parses; ``auto``: the model chooses; ``none``: no tools in the
                                                    prompt
    the output       -> ToolCallParser.parse()     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
                                                    blocks (Hermes, Qwen), a bare JSON call or list of calls, or,
                                                    forced, the schema's JSON -> tool calls and the text around them

The parser also says, while a stream is under way, whether the text so far may still become a call
(``may_be_call``): the formatter holds such text back and streams it as content once it cannot.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.engine.sampling.params import StructuredOutput

_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# Hermes' system prompt (as Qwen 2.5's and SmolLM3's templates write it).
_SYSTEM_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API gives it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def template_knows_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          knows_tools: bool) -> list[dict[str, Any]]:
    """The conversation as a template without tool support can render it: tools described in the system message,
    an assistant's calls and the tools' results written as the model would write and read them."""
    if knows_tools:
        return messages
    rendered = [_as_text(message) for message in messages]
    if not tools:
        return rendered
    described = _SYSTEM_TOOLS.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if rendered and rendered[0]["role"] == "system":
        return [{**rendered[0], "content": rendered[0]["content"] + "\n\n" + described}] + rendered[1:]
    return [{"role": "system", "content": described}] + rendered


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = "\n".join(f"{_TOOL_CALL_OPEN}\n{json.dumps(_call_object(call))}\n{_TOOL_CALL_CLOSE}" for call in calls)
    content = message.get("content") or ""
    return {"role": message["role"], "content": f"{content}\n{written}" if content else written}


def _call_object(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function["arguments"]
    try:
        arguments = json.loads(arguments)
    except (TypeError, json.JSONDecodeError):
        pass
    return {"name": function["name"], "arguments": arguments}


def forced_output(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool
                  ) -> StructuredOutput | None:
    """The JSON schema a ``required`` or named ``tool_choice`` forces: a list of calls (one at most unless
    ``parallel``) of the allowed functions, each ``{"name": ..., "arguments": {...}}``. None for auto and none."""
    if tool_choice == "required":
        allowed = tools
    elif isinstance(tool_choice, dict):
        allowed = [tool for tool in tools if tool["function"]["name"] == tool_choice["function"]["name"]]
    else:
        return None
    calls = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               "arguments": tool["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for tool in allowed]
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(json=json.dumps(schema))


class ToolCallParser:
    """The tool calls in one answer's text, for the functions the request offered."""

    def __init__(self, tools: list[dict[str, Any]], forced: bool):
        self.names = {tool["function"]["name"] for tool in tools}
        self.forced = forced  # the output is the forced schema's JSON list of calls

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content left, the calls); (text, []) when the text makes no call of an offered function."""
        if _TOOL_CALL_OPEN in text:
            return self._tagged(text)
        calls = self._json_calls(text.strip())
        return (None, calls) if calls else (text, [])

    def may_be_call(self, text: str) -> bool:
        """Whether the text so far (an answer's start) could still turn out to be a call."""
        head = text.lstrip()
        if self.forced or not head:
            return True
        return (head.startswith(("{", "[")) or _TOOL_CALL_OPEN.startswith(head[:len(_TOOL_CALL_OPEN)])
                or _TOOL_CALL_OPEN in text)

    def _tagged(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, content, rest = [], [], text
        while _TOOL_CALL_OPEN in rest:
            before, _, after = rest.partition(_TOOL_CALL_OPEN)
            body, closed, rest = after.partition(_TOOL_CALL_CLOSE)
            found = self._json_calls(body.strip())
            if not found or not closed and rest:
                content.append(before + _TOOL_CALL_OPEN + body + (_TOOL_CALL_CLOSE if closed else ""))
                continue
            content.append(before)
            calls += found
        content.append(rest)
        left = "".join(content).strip()
        return (left or None, calls) if calls else (text, [])

    def _json_calls(self, text: str) -> list[ToolCall]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return []
        items = value if isinstance(value, list) else [value]
        calls = [self._call(item) for item in items]
        return calls if calls and all(call is not None for call in calls) else []

    def _call(self, item: Any) -> ToolCall | None:
        if not isinstance(item, dict) or item.get("name") not in self.names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        return ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
