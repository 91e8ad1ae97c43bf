"""OpenAI's function calling (`tools`, `tool_choice`) as vLLM serves it for Llama-3 models.

A model is told of its tools through its chat template: a template that reads `tools` (its source
names it) gets them as transformers passes them (`apply_chat_template(..., tools=...)`). One that
does not (SmolLM2's, the tests' byte-level one) gets them as Llama-3.1's official template writes
them for a JSON tool call: a system message holding each function's definition as JSON and the
instruction to answer one JSON object {"name": ..., "parameters": {...}}. That reply is the call:

- tool_choice "required" or a named function: the reply is constrained (structured outputs) to
  `call_schema`, so it always parses as a call of one of the tools;
- "auto" (the default with tools): the reply is free; one that parses as a call of a tool
  becomes it (`parse_call`), anything else stays text;
- "none": plain text, the tools still shown to the model, as OpenAI does.

A history's assistant `tool_calls` are written back as the JSON reply that made them, and `tool`
messages (the results) keep their role, which templates without tool support render as any other.
Pure: no engine, no HTTP; the errors are ValueErrors naming the request's field.
"""

from __future__ import annotations

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
    {"name": ..., "parameters" or "arguments": {...}}; None otherwise."""
    try:
        reply = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(reply, dict) or reply.get("name") not in {f["name"] for f in tools}:
        return None
    arguments = reply.get("parameters", reply.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return reply["name"], json.dumps(arguments, ensure_ascii=False)


def tool_call(name: str, arguments: str) -> dict:
    """OpenAI's tool call of a response's message."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
