"""OpenAI's function calling (`tools`, `tool_choice`) as vLLM serves it for Llama-3 models.

A model is told of its tools through its chat template: a template that reads `tools` (its source
names it) gets them as transformers passes them (`apply_chat_template(..., tools=...)`). One that
does not (SmolLM2's, the tests' byte-level one) gets them as Llama-3.1's official template writes
them for a JSON tool call: a system message holding each function's definition as JSON and the
instruction to answer one JSON object {"name": ..., "parameters": {...}}. That reply is the call:

- tool_choice "required" or a named function: the reply is constrained (structured outputs) to
  `call_schema`, so it always parses as a call of one of the tools;
- "auto" (the default with tools): the reply is free; one that parses as a call of a tool
  becomes it (`parse_call`), anything else stays text (streamed: `CallStream`);
- "none": plain text, the tools still shown to the model, as OpenAI does.

A call's `arguments` are the model's own text of its parameters object, as OpenAI's are, so that a
streamed call's pieces (`CallStream`) add up to the unstreamed call's arguments exactly: re-dumping
the parsed object instead would hold each value back until complete (a number's digits, an escape,
a key given twice) and keep a second serializer in step with the first.

A history's assistant `tool_calls` are written back as the JSON reply that made them, and `tool`
messages (the results) keep their role, which templates without tool support render as any other.
Pure: no engine, no HTTP; the errors are ValueErrors naming the request's field.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence

# Llama-3.1's words for JSON tool calling (its official chat template, custom tool calling).
INSTRUCTION = ("Given the following functions, please respond with a JSON for a function call with its proper "
               "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
               "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n")
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served; `param` is the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def functions(tools: Sequence[dict] | None) -> list[dict]:
    """The `function` objects of OpenAI's `tools` ({"name", "description"?, "parameters"?}, a
    missing schema being an object of no declared fields); ToolError naming a malformed one."""
    found, names = [], set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolError(f"{where}.function needs a non-empty string name", "tools")
        if function["name"] in names:
            raise ToolError(f"{where}.function.name {function['name']!r} is given twice", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema (an object), got "
                            f"{type(parameters).__name__}", "tools")
        names.add(function["name"])
        found.append({**function, "parameters": parameters})
    return found


def chosen(tool_choice: str | dict | None, tools: list[dict]) -> str | None:
    """What `tool_choice` asks for: "none", "auto", "required" or a function's name (None: no
    tools); OpenAI's default is "auto" with tools. ToolError naming what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools: send the functions it may call in tools", "tool_choice")
        return None
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": ...}}}}, got {tool_choice!r}", "tool_choice")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("tool_choice names a function as {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice")
    if name not in {f["name"] for f in tools}:
        raise ToolError(f"tool_choice names the function {name!r}, which is not among tools "
                        f"({', '.join(f['name'] for f in tools)})", "tool_choice")
    return name


def call_schema(tools: list[dict], choice: str) -> dict:
    """The JSON schema of a reply calling one of `tools` ("required") or the one named `choice`:
    {"name": its name, "parameters": its arguments}."""

    def call(function: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": function["name"]},
                                                 "parameters": function["parameters"]},
                "required": ["name", "parameters"], "additionalProperties": False}

    picked = [f for f in tools if choice == "required" or f["name"] == choice]
    return call(picked[0]) if len(picked) == 1 else {"anyOf": [call(f) for f in picked]}


def template_reads_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the `tools` it is given (its source names them)."""
    return "tools" in (chat_template or "")


def system_message(tools: list[dict]) -> str:
    """Llama-3.1's JSON tool-calling text: the instruction, then each definition as JSON (on one
    line: Llama's template indents it by 4, which costs a long schema many tokens for nothing)."""
    definitions = "\n\n".join(json.dumps({"type": "function", "function": f}) for f in tools)
    return f"{INSTRUCTION}{definitions}"


def with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` telling the model of `tools` in a template that cannot: the tools' system text
    ahead of the first system message's, or a system message of its own first."""
    text = system_message(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{text}\n\n{first}" if first else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def history_message(message: dict, tool_calls: Sequence[dict] | None, reads_tools: bool) -> dict:
    """An assistant message of the history with the calls it made: for a template that reads
    tools, transformers' form (the arguments as a dict); otherwise the calls written as the JSON
    reply that made them."""
    if not tool_calls:
        return message
    calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
             for c in tool_calls]
    if reads_tools:
        return {**message, "tool_calls": [{"type": "function", "function": c} for c in calls]}
    text = "\n".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    return {**message, "content": f"{message['content']}\n{text}" if message["content"] else text}


def _arguments(arguments) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except (TypeError, json.JSONDecodeError):
        raise ToolError(f"a tool call's arguments must be a JSON object as text, got {arguments!r}",
                        "messages") from None
    if not isinstance(parsed, dict):
        raise ToolError(f"a tool call's arguments must be a JSON object, got {arguments!r}", "messages")
    return parsed


def parse_call(text: str, tools: list[dict]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) when `text` is one JSON object calling one of `tools`,
    {"name": ..., "parameters" or "arguments": {...}} with each key once; None otherwise. The
    arguments are the model's own text of that object ("{}" without one)."""
    scan = CallScan()
    scan.feed(text)
    if not scan.complete or scan.name not in {f["name"] for f in tools}:
        return None
    try:  # the scan reads the object's shape; json.loads checks the JSON
        json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    return scan.name, scan.arguments or "{}"


def tool_call(name: str, arguments: str) -> dict:
    """OpenAI's tool call of a response's message (streamed: its first delta, arguments "")."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# ---- a reply read as it streams --------------------------------------------------------------
PARAMETER_KEYS = ("parameters", "arguments")  # Llama-3.1's key, and the one some models write
_JSON_SPACE = " \t\n\r"
# Where CallScan is in the call's object: before it, at a key (after "{" or ","), in a key, before
# its ":", before its value, in a string, object or array, or other (number, literal) value,
# before "," or "}", after the object.
_START, _FIRST_KEY, _NEXT_KEY, _KEY, _COLON, _VALUE, _STRING, _NESTED, _SCALAR, _NEXT, _AFTER = range(11)


class CallScan:
    """A reply's text read as it grows as the JSON object of a call, {"name": ..., "parameters":
    {...}} (or "arguments"), its keys in any order, others among them: the name once its string is
    complete, and the span of the parameters object's text. It reads the shape, not the JSON
    (json.loads does, once the text is whole); each character once, whatever the pieces.

    `is_object`: None until the first non-space character, then whether it is "{". `broken`: the
    text cannot be such a call (a key twice, parameters and arguments both, a name that is not a
    string, parameters that are not an object, a character out of place); `trailing`: text follows
    the object. Reading stops at either."""

    def __init__(self):
        self.text = ""
        self.is_object: bool | None = None
        self.name: str | None = None
        self.closed = self.broken = self.trailing = False
        self._arguments_at: int | None = None  # where the parameters object starts in `text`
        self._arguments_end: int | None = None  # one past its closing brace, once read
        self._read = 0  # the characters read
        self._state = _START
        self._keys: set[str] = set()  # each parameters key counted as "parameters"
        self._key = ""
        self._at = 0  # the current key's or value's first character
        self._depth = 0  # open brackets in a nested value
        self._quoted = self._escaped = False  # in a string; after its backslash

    @property
    def complete(self) -> bool:
        """The text is one object of a call's shape, nothing after it."""
        return self.closed and not (self.broken or self.trailing) and self.name is not None

    @property
    def arguments(self) -> str:
        """The parameters object's text read so far ("" before it starts): what a later character
        cannot change, since the object runs to its closing brace."""
        if self._arguments_at is None:
            return ""
        end = self._read if self._arguments_end is None else self._arguments_end
        return self.text[self._arguments_at:end]

    def feed(self, text: str) -> None:
        self.text += text
        while self._read < len(self.text) and not (self.broken or self.trailing):
            self._step(self.text[self._read])
            self._read += 1

    def _step(self, c: str) -> None:
        state = self._state
        if state in (_START, _AFTER):  # around the object, any space (the text is stripped for json.loads)
            if c.isspace():
                return
            if state == _AFTER:
                self.trailing = True
            else:
                self.is_object = c == "{"
                self._state, self.broken = _FIRST_KEY, not self.is_object
        elif state in (_STRING, _KEY) or (state == _NESTED and self._quoted):
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._quoted = False
                if state == _KEY:
                    self._end_key()
                elif state == _STRING:
                    self._end_value()
        elif state == _NESTED:
            if c == '"':
                self._quoted = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if not self._depth:
                    self._end_value()
        elif state == _SCALAR:
            if c in _JSON_SPACE or c in ",}":
                self._state = _NEXT
                self._step(c)  # the value's end is the next part's start
        elif c in _JSON_SPACE:
            return
        elif state in (_FIRST_KEY, _NEXT_KEY) and c == '"':
            self._state, self._at = _KEY, self._read
        elif state == _COLON and c == ":":
            self._state = _VALUE
        elif state == _VALUE:
            self._start_value(c)
        elif state == _NEXT and c == ",":
            self._state = _NEXT_KEY
        elif state in (_FIRST_KEY, _NEXT) and c == "}":
            self._state, self.closed = _AFTER, True
        else:
            self.broken = True

    def _end_key(self) -> None:
        try:
            key = json.loads(self.text[self._at:self._read + 1])
        except json.JSONDecodeError:
            self.broken = True
            return
        counted = "parameters" if key in PARAMETER_KEYS else key
        self.broken = counted in self._keys
        self._keys.add(counted)
        self._state, self._key = _COLON, counted

    def _start_value(self, c: str) -> None:
        self._at = self._read
        if (self._key == "name" and c != '"') or (self._key == "parameters" and c != "{") or c in ",}]:":
            self.broken = True
        elif c == '"':
            self._state = _STRING
        elif c in "{[":
            self._state, self._depth = _NESTED, 1
            if self._key == "parameters":
                self._arguments_at = self._read
        else:
            self._state = _SCALAR

    def _end_value(self) -> None:
        self._state = _NEXT
        if self._key == "parameters":
            self._arguments_end = self._read + 1
        elif self._key == "name":
            try:
                self.name = json.loads(self.text[self._at:self._read + 1])
            except json.JSONDecodeError:
                self.broken = True


@dataclasses.dataclass(frozen=True)
class Piece:
    """What a stretch of a streamed reply adds: content text, or the call's start (its name) and its
    arguments' next text; `call` (at the end): the reply is a call (finish_reason "tool_calls")."""

    text: str = ""
    name: str | None = None
    arguments: str = ""
    call: bool = False

    @property
    def empty(self) -> bool:
        return not (self.text or self.name is not None or self.arguments)


class CallStream:
    """A chat reply to a request with tools, read as its text streams (`feed` each released piece,
    `finish` with the last). Held while its start may be a call's; then either OpenAI's incremental
    tool call, once its object names a tool (the name, then the parameters object's text as it
    arrives; parameters written before the name wait for it), or text, the held text first, once it
    cannot be a call: its first non-space character is not "{", its name is not a tool's, or its
    object is not of a call's shape (`CallScan.broken`). Neither of those can turn into a call
    later (`parse_call` reads the same scan), so the text is the unstreamed reply's content.

    A call streamed from its start that is not one at the end after all (cut short by max_tokens,
    text after the object, JSON that does not parse) ends as the unstreamed reply does: its whole
    text as content, with the engine's finish reason rather than "tool_calls"."""

    def __init__(self, tools: list[dict]):
        self.tools, self.names = tools, {f["name"] for f in tools}
        self.scan = CallScan()
        self.mode = "undecided"  # then "text" or "call"
        self._sent = 0  # of the call's arguments
        self._started = False  # the call's name is out

    @property
    def holding(self) -> bool:
        """Whether the text read waits (the reply may or may not be a call)."""
        return self.mode == "undecided"

    def feed(self, text: str) -> Piece:
        """What `text` (the reply's next released text) lets the stream send."""
        if self.mode == "text":  # decided: nothing more to read
            return Piece(text=text)
        self.scan.feed(text)
        if self.mode == "undecided":
            self._decide()
        if self.mode == "text":
            return Piece(text=self.scan.text)  # the text held so far
        if self.mode != "call":
            return Piece()
        name = None if self._started else self.scan.name
        self._started = True
        arguments = self.scan.arguments[self._sent:]
        self._sent += len(arguments)
        return Piece(name=name, arguments=arguments)

    def finish(self, text: str) -> Piece:
        """The end of the reply, given its last released text."""
        piece = self.feed(text)
        if self.mode == "undecided":  # cut short before it showed: not a call (parse_call reads it so too)
            return Piece(text=self.scan.text)
        if self.mode == "text":
            return piece
        call = parse_call(self.scan.text, self.tools)
        sent = self.scan.arguments[:self._sent]  # this piece's among them
        if call is None or call[0] != self.scan.name or not call[1].startswith(sent):
            return Piece(text=self.scan.text)
        return Piece(name=piece.name, arguments=piece.arguments + call[1][len(sent):], call=True)

    def _decide(self) -> None:
        scan = self.scan
        if scan.name in self.names and not scan.broken:
            self.mode = "call"
        elif scan.is_object is False or scan.broken or scan.closed or scan.name is not None:
            self.mode = "text"
