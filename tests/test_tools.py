"""serve/tools.py on its own: the tools in the rendered prompt, with a template that reads them and
with one that does not (the byte tokenizer of tests/conftest.py), the call schema, a reply parsed
as a call, a reply read as it streams, and what tool_choice refuses."""

from __future__ import annotations

import itertools
import json
import random

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
    # The arguments are the model's own text of the object, not a re-dump of it.
    ('{"name":"get_time","parameters":{"zone":"UTC"}}', ("get_time", '{"zone":"UTC"}')),
    ('{"name": "get_time", "parameters": {"n": 1.50, "s": "\\u00fc"}}', ("get_time", '{"n": 1.50, "s": "\\u00fc"}')),
    ('{"name": "get_time", "parameters": {}, "name": "get_weather"}', None),  # a key twice
    ('{"name": "get_time", "parameters": {}, "arguments": {}}', None),
    ('{"name": "get_time", "parameters": {"zone": "UTC"}} Done.', None),  # text after it
    ('{"name": "get_time", "parameters": {"zone": UTC}}', None),  # not JSON
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


# ---- a reply read as it streams ----------------------------------------------------------------
def stream(text: str, cuts: list[int]) -> list[T.Piece]:
    """The pieces a CallStream gives for `text` released in pieces ending at `cuts` (then its end)."""
    calls = T.CallStream(T.functions(TOOLS))
    bounds = [0, *cuts, len(text)]
    return [calls.feed(text[a:b]) for a, b in itertools.pairwise(bounds[:-1])] + [calls.finish(text[bounds[-2]:])]


def every_cut(text: str) -> list[list[int]]:
    """The text a character at a time, in 3-character pieces, whole, and whole with an empty last piece."""
    return [list(range(1, len(text))), list(range(3, len(text), 3)), [], [len(text)]]


def assert_streamed_as_call(text: str) -> list[T.Piece]:
    """Every way of releasing `text` streams it as its call: the name once, first, then argument
    pieces that add up to the unstreamed call's arguments, and no content."""
    name, arguments = T.parse_call(text, T.functions(TOOLS))
    for cuts in every_cut(text):
        pieces = stream(text, cuts)
        started = [i for i, p in enumerate(pieces) if p.name is not None]
        assert [pieces[i].name for i in started] == [name]
        assert not any(p.arguments for p in pieces[:started[0]])
        assert "".join(p.arguments for p in pieces) == arguments
        assert not any(p.text for p in pieces) and pieces[-1].call
    return stream(text, every_cut(text)[0])


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '{"name":"get_time","parameters":{"zone":"UTC"}}',  # compact, as the call's grammar writes it
    '{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": [1, {"x": "}"}]}',
    '{"id": 1, "name": "get_\\u0074ime", "parameters": {"zone": "UTC"}}',  # another key first; an escaped name
    # braces, brackets, quotes and backslashes inside strings; nested objects and arrays
    '{"name": "get_weather", "parameters": {"city": "O\\"s}{l]o\\\\", "days": [1, [2, {"a": "["}]], "n": {}}}',
])
def test_a_call_streams_its_name_then_each_character_of_its_arguments_as_it_arrives(text):
    by_character = assert_streamed_as_call(text)
    assert sum(bool(p.arguments) for p in by_character) == len(T.parse_call(text, T.functions(TOOLS))[1])


@pytest.mark.parametrize("text, arguments", [
    (' \n{"parameters": {"city": "Oslo"}, "name": "get_weather"}\n', '{"city": "Oslo"}'),  # they wait for the name
    ('{"name": "get_time"}', "{}"),  # none: "{}" at the end
])
def test_arguments_before_the_name_or_none_at_all_come_with_the_name_or_the_end(text, arguments):
    by_character = assert_streamed_as_call(text)
    assert [p.arguments for p in by_character if p.arguments] == [arguments]


def test_the_arguments_of_any_json_streamed_in_any_pieces_are_the_models_text_of_them():
    rng = random.Random(0)
    alphabet = ['"', "\\", "{", "}", "[", "]", ",", ":", " ", "a", "é", "\n", "\u2028"]

    def value(depth: int):
        kind = rng.randrange(7 if depth < 3 else 4)
        if kind < 4:
            return [None, True, rng.randint(-99, 99) * 10 ** rng.randint(-2, 2),
                    "".join(rng.choices(alphabet, k=rng.randrange(5)))][kind]
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        return {"".join(rng.choices(alphabet, k=rng.randrange(4))): value(depth + 1) for _ in range(rng.randrange(3))}

    for _ in range(40):
        parameters = {f"k{i}": value(0) for i in range(rng.randrange(4))}
        separators = rng.choice([(",", ":"), (", ", ": ")])
        arguments = json.dumps(parameters, ensure_ascii=rng.random() < 0.5, separators=separators)
        text = f'{{"name": "get_weather", "parameters": {arguments}}}'
        assert T.parse_call(text, T.functions(TOOLS)) == ("get_weather", arguments)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
        pieces = stream(text, cuts)
        assert "".join(p.arguments for p in pieces) == arguments and pieces[-1].call


@pytest.mark.parametrize("text, held", [
    ("  It is {sunny}.", 3),  # the spaces wait for what follows them
    ('{"name": "get_mail", "parameters": {"to": "x"}}', len('{"name": "get_mail"')),  # not a tool
    ('{"tool": "get_time", "parameters": {}}', len('{"tool": "get_time", "parameters": {}}')),  # no name
    ('{"name": 7, "parameters": {}}', len('{"name": 7')),
    ('{"zone": "UTC", "zone": 1, "name": "get_time"}', len('{"zone": "UTC", "zone"')),  # a key twice
    ('{"name": "get_ti', len('{"name": "get_ti')),  # cut short
])
def test_a_reply_streams_as_text_once_it_cannot_be_a_call_the_held_text_first(text, held):
    assert T.parse_call(text, T.functions(TOOLS)) is None
    pieces = stream(text, list(range(1, len(text))))
    assert all(p.empty for p in pieces[:held - 1]) and pieces[held - 1].text == text[:held]
    assert "".join(p.text for p in pieces) == text
    assert not any(p.name or p.arguments or p.call for p in pieces)


@pytest.mark.parametrize("text", [
    '{"name": "get_time", "parameters": {"zone": "UTC"}}\nThat is the call.',  # text after it
    '{"name": "get_time", "parameters": {"zone": "UT',  # cut short (max_tokens)
    '{"name": "get_time", "parameters": {"zone": UTC}}',  # not JSON
    '{"name": "get_time", "parameters": {}, "name": "get_weather"}',  # its name twice
])
def test_a_streamed_call_that_is_not_one_at_its_end_ends_as_the_unstreamed_reply_its_text(text):
    assert T.parse_call(text, T.functions(TOOLS)) is None
    pieces = stream(text, list(range(1, len(text))))
    assert [p.name for p in pieces if p.name] == ["get_time"]  # streamed before the end showed otherwise
    assert pieces[-1] == T.Piece(text=text)  # the whole text as content; finish_reason stays the engine's
    assert not any(p.text for p in pieces[:-1])


def test_every_prefix_of_a_reply_streams_to_what_the_unstreamed_reply_is():
    """Cut anywhere (max_tokens), with text or a second object after it: the stream ends as the call
    parse_call reads, or as the text, whatever pieces the text comes in."""
    rng = random.Random(1)
    call = ' {"id": "x\\"}", "name": "get_weather", "parameters": {"city": "Oslo", "days": [1, {"a": "]"}]}} '
    for text in [call[:n] for n in range(len(call) + 1)] + [call + " ok", call + call, "Sure. " + call]:
        parsed = T.parse_call(text, T.functions(TOOLS))
        cuts = sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randrange(1, 8))))
        pieces = stream(text, cuts)
        if parsed is not None:
            assert pieces[-1].call and "".join(p.arguments for p in pieces) == parsed[1]
            assert [p.name for p in pieces if p.name] == [parsed[0]] and not any(p.text for p in pieces)
            continue
        assert not pieces[-1].call
        streamed_call = any(p.name for p in pieces)  # then the whole text comes at the end
        assert (pieces[-1].text if streamed_call else "".join(p.text for p in pieces)) == text
