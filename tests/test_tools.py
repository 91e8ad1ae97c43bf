"""serve/tools.py on its own: the tools in the rendered prompt, with a template that reads them and
with one that does not (the byte tokenizer of tests/conftest.py), the call schema, a reply parsed
as a call, and what tool_choice refuses."""

from __future__ import annotations

import json

import pytest

from eagle3_jax.serve import tools as T

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"name": "get_weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
HISTORY_CALL = [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
# A template that renders `tools` itself, as Llama-3.1's and Qwen's do.
TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %}CALL {{ c['function'] | tojson }}{% endfor %}\n{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from conftest import write_byte_tokenizer
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("byte_tokenizer")
    write_byte_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


def test_a_template_without_tools_gets_them_as_llama_3_1s_system_message(tokenizer):
    assert not T.template_reads_tools(tokenizer.chat_template)
    functions = T.functions(TOOLS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                T.history_message({"role": "assistant", "content": ""}, HISTORY_CALL, reads_tools=False),
                {"role": "tool", "content": "-3 C"}]
    rendered = tokenizer.apply_chat_template(T.with_tools(messages, functions), tokenize=False,
                                             add_generation_prompt=True)
    system = rendered.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n" + T.INSTRUCTION) and system.endswith("Be brief.")
    for function in functions:  # each definition, as JSON
        assert json.dumps({"type": "function", "function": function}) in system
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Oslo"}}<|im_end|>' in rendered
    assert "<|im_start|>tool\n-3 C<|im_end|>" in rendered
    alone = T.with_tools([{"role": "user", "content": "hi"}], functions)
    assert [m["role"] for m in alone] == ["system", "user"]


def test_a_template_that_reads_tools_gets_them_and_the_calls_as_transformers_passes_them(tokenizer):
    assert T.template_reads_tools(TOOL_TEMPLATE)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                T.history_message({"role": "assistant", "content": ""}, HISTORY_CALL, reads_tools=True)]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False)
    assert '"name": "get_weather"' in rendered.splitlines()[0] and '"name": "get_time"' in rendered.splitlines()[0]
    assert 'CALL {"name": "get_weather", "arguments": {"city": "Oslo"}}' in rendered  # arguments as a dict
    assert T.INSTRUCTION not in rendered


def test_the_call_schema_takes_exactly_the_calls_of_the_chosen_tools():
    functions = T.functions(TOOLS)
    weather = {"name": "get_weather", "parameters": {"city": "Oslo"}}
    clock = {"name": "get_time", "parameters": {"zone": "UTC"}}
    any_tool, named = T.call_schema(functions, "required"), T.call_schema(functions, "get_time")
    for call in (weather, clock):
        jsonschema.validate(call, any_tool)
    jsonschema.validate(clock, named)
    for wrong, schema in ((weather, named), ({"name": "get_time", "parameters": {"zone": "PST"}}, any_tool),
                          ({"name": "get_time"}, any_tool), ({**clock, "extra": 1}, any_tool)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


@pytest.mark.parametrize("text, call", [
    ('{"name": "get_time", "parameters": {"zone": "UTC"}}', ("get_time", '{"zone": "UTC"}')),
    (' {"name": "get_weather", "arguments": {"city": "Zürich"}}\n', ("get_weather", '{"city": "Zürich"}')),
    ('{"name": "get_time"}', ("get_time", "{}")),
    ('{"name": "get_mail", "parameters": {}}', None),  # not a tool
    ('{"name": "get_time", "parameters": [1]}', None),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}', None),  # cut short
    ("It is sunny.", None),
])
def test_a_reply_is_a_call_only_when_it_is_one_json_object_calling_a_tool(text, call):
    assert T.parse_call(text, T.functions(TOOLS)) == call


@pytest.mark.parametrize("tools, tool_choice, words, param", [
    (None, "required", "tool_choice needs tools", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "get_mail"}}, "'get_mail', which is not among tools",
     "tool_choice"),
    (TOOLS, {"type": "function"}, "names a function as", "tool_choice"),
    (TOOLS, "always", "must be none, auto, required", "tool_choice"),
    ([{"type": "retrieval"}], None, "tools[0] must be", "tools"),
    ([TOOLS[0], TOOLS[0]], None, "given twice", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "must be a JSON schema", "tools"),
])
def test_tools_and_tool_choice_that_cannot_be_served_name_their_field(tools, tool_choice, words, param):
    with pytest.raises(T.ToolError, match=words.replace("[", r"\[")) as e:
        T.chosen(tool_choice, T.functions(tools))
    assert e.value.param == param


def test_tool_choice_defaults_to_auto_with_tools_and_to_nothing_without():
    functions = T.functions(TOOLS)
    assert (T.chosen(None, functions), T.chosen("none", []), T.chosen(None, [])) == ("auto", None, None)
    assert T.chosen({"type": "function", "function": {"name": "get_time"}}, functions) == "get_time"
    assert T.functions([{"type": "function", "function": {"name": "f"}}])[0]["parameters"]["type"] == "object"
