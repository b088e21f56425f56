"""Tool calls: the prompt a template without tool support gets, the grammar a forced tool_choice makes, and how
an answer's text becomes tool calls."""

import json

import pytest

from splitserve.engine.sampling.params import StructuredOutput
from splitserve.router.openai.tool_calls import (
    ToolCallParser,
    forced_output,
    messages_for_template,
    template_knows_tools,
)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "neg"}}]


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    rendered = messages_for_template(messages, TOOLS, knows_tools=False)
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TOOLS[0]) in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
                                                          "</tool_call>"}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert messages_for_template(messages, TOOLS, knows_tools=True) is messages
    assert template_knows_tools("{% if tools %}...{% endif %}") and not template_knows_tools("{{ messages }}")


def test_forced_tool_choice_is_a_list_of_calls_of_the_allowed_functions():
    named = json.loads(forced_output(TOOLS, {"type": "function", "function": {"name": "neg"}}, parallel=False).json)
    assert named["maxItems"] == 1 and named["items"]["properties"]["name"] == {"const": "neg"}
    required = json.loads(forced_output(TOOLS, "required", parallel=True).json)
    assert "maxItems" not in required and len(required["items"]["anyOf"]) == 2
    assert forced_output(TOOLS, "auto", parallel=True) is None
    assert isinstance(forced_output(TOOLS, "required", parallel=True), StructuredOutput)


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', None, [("add", '{"a": 1}')]),
    ('Sure.\n<tool_call>{"name": "neg", "arguments": {}}</tool_call>', "Sure.", [("neg", "{}")]),
    ('[{"name": "add", "arguments": {"a": 2}}, {"name": "neg", "parameters": {"x": 1}}]', None,
     [("add", '{"a": 2}'), ("neg", '{"x": 1}')]),
    ('{"name": "mul", "arguments": {}}', '{"name": "mul", "arguments": {}}', []),  # not an offered tool
    ("<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("Hello there", "Hello there", []),
])
def test_the_answers_calls_are_parsed_and_the_rest_is_content(text, content, calls):
    parsed_content, parsed_calls = ToolCallParser(TOOLS, forced=False).parse(text)
    assert parsed_content == content
    assert [(call.name, call.arguments) for call in parsed_calls] == calls


def test_text_is_held_back_only_while_it_may_still_be_a_call():
    parser = ToolCallParser(TOOLS, forced=False)
    assert parser.may_be_call("") and parser.may_be_call("  <tool") and parser.may_be_call('{"na')
    assert not parser.may_be_call("Hello") and not parser.may_be_call("<b>")
    assert ToolCallParser(TOOLS, forced=True).may_be_call("anything")
