"""OpenAI's request bodies and response shapes, with vLLM's sampling extensions (top_k, min_p,
ignore_eos, stop_token_ids, structured_outputs). Pure: no engine, no HTTP.

Logprobs as OpenAI gives them: chat's `logprobs: true` (+ `top_logprobs: N`) a list of
{token, logprob, bytes, top_logprobs} per token; completions' `logprobs: N` the legacy
{tokens, token_logprobs, top_logprobs, text_offset}, with `echo` the prompt's first (its first
token's None) and `max_tokens: 0` a prompt scored by a prefill alone. Up to MAX_LOGPROBS (20)
each, where OpenAI's completions stop at 5. The entries come in as the Python API's dicts, token id
-> Logprob (api.py), the token itself first."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from eagle3_jax.engine.scheduler import RequestMetrics
from eagle3_jax.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from eagle3_jax.serve import tools as T

LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf, which JSON cannot carry


class APIError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class RequestBody(BaseModel):
    """What both endpoints share. Unknown fields are ignored, as OpenAI's server does."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: completions with echo alone (`check`)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    # What the output must match: OpenAI's {"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"name", "schema", "strict"}}, or vLLM's {"json" | "regex" | "choice" | "grammar": ...}.
    response_format: dict | None = None
    structured_outputs: dict | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        return "logit_bias" if self.logit_bias else None

    def check(self) -> None:
        """400 naming the first field set to what this server does not do, or in a combination it refuses."""
        if field := self.unsupported():
            raise invalid(f"{field} is not supported by this server", field)
        if self.max_tokens == 0 and not self.scores_prompt_only:
            raise invalid("max_tokens must be at least 1 (0 only on completions with echo, to score the prompt)",
                          "max_tokens")

    @property
    def scores_prompt_only(self) -> bool:
        """A prompt scored by a prefill alone: nothing generated."""
        return False

    def logprob_fields(self) -> dict:
        """SamplingParams' logprobs and prompt_logprobs as this body asks for them."""
        return {}

    @property
    def top_logprobs_listed(self) -> int | None:
        """How many likeliest tokens each token's logprobs list; None: no logprobs in the response."""
        return None

    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def output_limit_field(self) -> str:
        return "max_tokens"

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """OpenAI's defaults (temperature 1, top_p 1; top_k off, or -1 as vLLM has it); no
        max_tokens: the rest of the context. Raises APIError 400 naming a field out of range."""
        limit = self.output_limit()
        try:
            return SamplingParams(
                max_tokens=default_max_tokens if limit is None else limit, **self.logprob_fields(),
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k, min_p=self.min_p or 0.0,
                seed=self.seed, stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                ignore_eos=self.ignore_eos, n=self.n, structured_outputs=self.structured())
        except ValueError as e:  # SamplingParams' messages start with the field's name
            raise invalid(str(e), str(e).split()[0]) from None

    @property
    def structured_field(self) -> str:
        """The field that asked for a structured output (for an error's param)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured(self) -> StructuredOutputsParams | None:
        """What the output must match, from response_format or structured_outputs (None: free text);
        APIError 400 naming a malformed one. Whether it compiles is the engine's to say."""
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text" and self.structured_outputs is not None:
            raise invalid("response_format and structured_outputs both constrain the output: send one",
                          "structured_outputs")
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams.of(self.structured_outputs)
            except (ValueError, TypeError) as e:
                raise invalid(str(e), "structured_outputs") from None
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.get("type") != "json_schema":
            raise invalid(f"response_format type must be text, json_object or json_schema, got {fmt.get('type')!r}",
                          "response_format")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format json_schema needs a json_schema object: {\"name\": ..., \"schema\": {...}}",
                          "response_format")
        schema = spec.get("schema")
        if schema is None:  # OpenAI's schema is optional: then any JSON object
            return StructuredOutputsParams(json_object=True)
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as e:
            raise invalid(str(e).replace("structured_outputs json", "response_format json_schema.schema"),
                          "response_format") from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]  # OpenAI's roles
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def as_template_input(self, developer_role: bool = True, reads_tools: bool = False) -> dict:
        """{"role", "content"} with the text parts joined, as chat templates take it; without
        `developer_role` (a template that never names it) a developer message is the system's,
        as OpenAI means it. An assistant's tool calls and a tool result's call id as tools.py
        writes them for the template (`reads_tools`: it renders tools itself)."""
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" and not developer_role else self.role
        message = {"role": role, "content": content}
        if self.tool_call_id is not None and reads_tools:
            message["tool_call_id"] = self.tool_call_id
        try:
            return T.history_message(message, self.tool_calls, reads_tools)
        except (T.ToolError, KeyError, TypeError):
            raise invalid("an assistant message's tool_calls must be [{\"id\", \"type\": \"function\", "
                          "\"function\": {\"name\", \"arguments\": a JSON object as text}}]", "messages") from None


class ChatCompletionRequest(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")

    def logprob_fields(self) -> dict:
        return {} if self.top_logprobs_listed is None else {"logprobs": self.top_logprobs_listed}

    @property
    def top_logprobs_listed(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self) -> tuple[list[dict], str | None]:
        """(the tools' functions, what tool_choice asks: "none", "auto", "required", a function's
        name, or None without tools); APIError 400 naming a malformed field."""
        try:
            functions = T.functions(self.tools)
            return functions, T.chosen(self.tool_choice, functions)
        except T.ToolError as e:
            raise invalid(str(e), e.param) from None

    @property
    def forced_call(self) -> bool:
        """Whether the reply must be a tool call (tool_choice "required" or a function)."""
        return self.tool_use()[1] not in (None, "none", "auto")

    @property
    def structured_field(self) -> str:
        return "tools" if self.forced_call else super().structured_field

    def structured(self) -> StructuredOutputsParams | None:
        """A forced tool call constrains the reply to the call's JSON schema (tools.py)."""
        functions, choice = self.tool_use()
        if choice in (None, "none", "auto"):
            return super().structured()
        if super().structured() is not None:
            raise invalid(f"tool_choice {self.tool_choice!r} and {super().structured_field} both constrain the "
                          "output: send one", "tool_choice")
        return StructuredOutputsParams(json=T.call_schema(functions, choice))

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def output_limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


class CompletionRequest(RequestBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool = Field(False, strict=True)
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported()

    @property
    def scores_prompt_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def logprob_fields(self) -> dict:
        """With echo, the prompt's logprobs too (a prompt scored alone needs them, whatever `logprobs` says)."""
        fields = {} if self.logprobs is None else {"logprobs": self.logprobs}
        if self.echo and (self.logprobs is not None or self.scores_prompt_only):
            fields["prompt_logprobs"] = self.logprobs or 0
        return fields

    @property
    def top_logprobs_listed(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts: texts or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(t, int) for t in self.prompt):
            return [self.prompt]
        return list(self.prompt)


def check_supported(body: RequestBody) -> None:
    body.check()


def check_fits(body: RequestBody, prompt_tokens: int, max_model_len: int) -> None:
    """400 when the output limit asked for does not fit beside the prompt, as OpenAI and vLLM
    answer, rather than a reply cut at the context's end; without one the reply fills the rest."""
    wanted = body.output_limit()
    if wanted is None or prompt_tokens + wanted <= max_model_len:
        return
    field = body.output_limit_field
    raise APIError(400, f"{field} {wanted} does not fit: the prompt has {prompt_tokens} tokens and max_model_len is "
                   f"{max_model_len} ({prompt_tokens} + {wanted} > {max_model_len}); ask for at most "
                   f"{max_model_len - prompt_tokens}, or leave {field} out to fill the context", param=field,
                   code="context_length_exceeded")


# ---- responses -----------------------------------------------------------------------------
@dataclasses.dataclass
class Choice:
    """One finished sample as a response lists it; `logprobs` its tokens' (`chat_logprobs`,
    `completion_logprobs`: what the body asked), None where not asked."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    logprobs: dict | None = None
    tool_calls: list[dict] | None = None  # the reply as OpenAI's tool calls (then no content)

    def as_call(self, tools: list[dict]) -> Choice:
        """This choice as a call of one of `tools` when its text is one (tools.py), else as it is."""
        call = T.parse_call(self.text, tools) if self.finish_reason != "error" else None
        if call is None:
            return self
        return dataclasses.replace(self, tool_calls=[T.tool_call(*call)], finish_reason="tool_calls")


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative_decoding(metrics: RequestMetrics) -> dict:
    """A request's speculation as vLLM reports it: drafts are the iterations that verified
    proposals; the mean acceptance length counts the bonus token (1 + accepted / drafts)."""
    drafts = metrics.speculative_iterations
    return {"num_drafts": drafts, "num_draft_tokens": metrics.drafted, "num_accepted_tokens": metrics.accepted,
            "num_accepted_tokens_per_pos": list(metrics.accepted_at),
            "mean_acceptance_length": 1 + metrics.accepted / drafts if drafts else 1.0}


def request_metrics(choices: list[Choice]) -> dict | None:
    """vLLM's per-request metrics object: one generation stream's, so none for n > 1."""
    if len(choices) != 1:
        return None
    return {"speculative_decoding": speculative_decoding(choices[0].metrics)}


def chat_message(choice: Choice) -> dict:
    if choice.tool_calls:
        return {"role": "assistant", "content": None, "tool_calls": choice.tool_calls}
    return {"role": "assistant", "content": choice.text}


def chat_response(id: str, model: str, choices: list[Choice], prompt_tokens: int) -> dict:
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "message": chat_message(c),
                         "logprobs": c.logprobs, "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
            "metrics": request_metrics(choices)}


def completion_response(id: str, model: str, choices: list[Choice], prompt_tokens: int) -> dict:
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                        for c in choices],
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices)),
            "metrics": request_metrics(choices)}


def with_token_ids(response: dict, prompt_token_ids: list[list[int]], choices: list[Choice]) -> dict:
    """vLLM's return_token_ids fields: the prompt's ids (a list per prompt for completions of
    several) and each choice's."""
    ids = {c.index: c.token_ids for c in choices}
    for choice in response["choices"]:
        choice["token_ids"] = ids[choice["index"]]
    response["prompt_token_ids"] = prompt_token_ids[0] if len(prompt_token_ids) == 1 else prompt_token_ids
    return response


def chat_chunk(id: str, model: str, created: int, choices: list[dict], **extra) -> dict:
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            **extra}


def chat_delta(index: int, content: str | None = None, role: str | None = None,
               finish_reason: str | None = None, logprobs: dict | None = None,
               tool_calls: list[dict] | None = None) -> dict:
    # The opening delta (the role's) has content: "", or null for a reply that may be a call.
    delta = {"role": role, "content": content} if role else {} if content is None else {"content": content}
    if tool_calls:  # a stream's calls carry their place in the list
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(id: str, model: str, created: int, choices: list[dict], **extra) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices, **extra}


def completion_delta(index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


# ---- logprobs ------------------------------------------------------------------------------
def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _likeliest(entry: dict, top: int) -> list:
    """The `top` likeliest Logprobs of an entry, best first (the token itself among them by its rank)."""
    return sorted(entry.values(), key=lambda lp: lp.rank)[:top]


def _text(lp) -> str:
    return lp.decoded_token or ""


def chat_logprobs(entries: list[dict], top: int, token_bytes: dict[int, list[int]]) -> dict:
    """A chat choice's `logprobs` (or a chunk's, for its tokens): per token its text, logprob, bytes
    (`token_bytes`: token id -> its bytes) and the `top` likeliest tokens'."""

    def token(i: int, lp) -> dict:
        return {"token": _text(lp), "logprob": _floor(lp.logprob), "bytes": token_bytes[i]}

    content = []
    for entry in entries:
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)[:top]
        content.append({**token(*next(iter(entry.items()))), "top_logprobs": [token(*item) for item in ranked]})
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: list[str], entries: list[dict | None], top: int, offset: int = 0) -> dict:
    """A completion choice's `logprobs` (or a chunk's) over `tokens` (each token's text) and their
    entries (None: the prompt's first token, which has none): each token's logprob, a dict of it and
    the `top` likeliest (OpenAI's up to top + 1), and where each token's text starts, from `offset`."""
    token_logprobs, top_logprobs, text_offset = [], [], []
    for text, entry in zip(tokens, entries):
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        own = next(iter(entry.values()))
        token_logprobs.append(_floor(own.logprob))
        top_logprobs.append({_text(lp): _floor(lp.logprob) for lp in [own, *_likeliest(entry, top)]})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}
