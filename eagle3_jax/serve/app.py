"""The HTTP routes: OpenAI's /v1/models, /v1/chat/completions and /v1/completions, /health and
/metrics. Every refusal is OpenAI's error body with its status; nothing here waits on the engine
except a request's own updates. Chat's tools: tools.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from eagle3_jax.api import LLM, Prompt
from eagle3_jax.engine.scheduler import RequestError
from eagle3_jax.engine.structured import GrammarError
from eagle3_jax.sampling_params import SamplingParams, StructuredOutputsParams
from eagle3_jax.serve import protocol as P
from eagle3_jax.serve import tools as T
from eagle3_jax.serve.detokenize import TextStream
from eagle3_jax.serve.engine_loop import EngineLoop, QueueFull, Submission, Unavailable, Update
from eagle3_jax.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"


@dataclasses.dataclass(frozen=True)
class Settings:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 4 << 20


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    """What differs between chat and completions: ids, response, stream and logprobs shapes."""

    kind: str  # the id prefix
    response: Callable
    chunk: Callable
    delta: Callable  # (index, text, finish_reason=None, logprobs=None) -> a chunk's choice
    role_first: bool  # chat streams open each choice with the assistant role
    logprobs: Callable  # (llm, token texts, entries, top, text offset) -> a choice's logprobs


CHAT = _Endpoint("chatcmpl", P.chat_response, P.chat_chunk,
                 lambda i, text, reason=None, logprobs=None: P.chat_delta(i, text or None, finish_reason=reason,
                                                                          logprobs=logprobs), True,
                 lambda llm, tokens, entries, top, offset: P.chat_logprobs(
                     entries, top, llm.token_bytes(i for entry in entries for i in entry)))
COMPLETION = _Endpoint("cmpl", P.completion_response, P.completion_chunk, P.completion_delta, False,
                       lambda llm, tokens, entries, top, offset: P.completion_logprobs(tokens, entries, top, offset))


@dataclasses.dataclass
class _Sample:
    """One sample's text and logprobs as its updates arrive; `echo`: the prompt's text and ids to
    put first (completions' echo), until they are sent."""

    text: TextStream
    echo: tuple[str, list[int]] | None = None
    logprobs: list = dataclasses.field(default_factory=list)  # its tokens' TokenLogprobs so far
    prompt_logprobs: list | None = None
    offset: int = 0  # the next token's text offset (completions' logprobs)
    calls: T.CallStream | None = None  # a streamed chat reply to a request with tools, read as a call
    sent: int = 0  # its tokens whose ids and logprobs a chunk carried (a reply with tools)

    def add(self, update: Update) -> None:
        self.logprobs += update.logprobs or []
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs


class OpenAIServer:
    """What the routes share: the engine (through its loop), the tokenizer's thread, the settings."""

    def __init__(self, llm: LLM, engine_loop: EngineLoop, settings: Settings):
        self.llm, self.engine_loop, self.settings = llm, engine_loop, settings
        # One thread: a fast tokenizer used from several at once can fail ("Already borrowed").
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._to_encode: list[tuple[Prompt, list | None, asyncio.Future]] = []  # waiting for that thread (`encode`)
        self._encoding = False  # a batch of them is on it
        self.max_model_len = llm.engine.cfg.max_model_len
        # Whether the chat template renders OpenAI's developer role itself (else it is the system's).
        template = str(getattr(llm.tokenizer, "chat_template", None) or "")
        self.developer_role = "developer" in template
        self.reads_tools = T.template_reads_tools(template)  # else tools.py writes them as a system message

    async def check_key(self, request: Request) -> None:
        """401 unless the request carries the API key (where one is set). A coroutine: FastAPI runs a
        plain function dependency on a worker thread, a hand-over and back for every request."""
        if self.settings.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.settings.api_key.encode()):
            raise P.APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                             "authentication_error", code="invalid_api_key")

    def check_body(self, body: P.RequestBody) -> None:
        if body.model != self.settings.model_name:
            raise P.APIError(404, f"the model {body.model!r} does not exist; this server serves "
                             f"{self.settings.model_name!r}", param="model", code="model_not_found")
        P.check_supported(body)

    async def encode(self, prompt: Prompt, param: str, tools: list | None = None) -> list[int]:
        """The prompt's token ids (`Codec.encode`, with `tools` for the chat template), on the
        tokenizer's thread; 400 naming `param` where the prompt is unusable. Prompts that arrive
        while a batch is encoded there wait and go next as one (`Codec.encode_each`, one call of the
        tokenizers library for many): a burst of 64 requests is a few jobs on that thread, not 64,
        each handed over and back, each waiting for the GIL while the engine's thread steps."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._to_encode.append((prompt, tools, future))
        if len(self._to_encode) == 1 and not self._encoding:
            loop.call_soon(self._encode_waiting)  # after this turn of the event loop: its arrivals join
        try:
            return await future
        except RequestError as e:
            raise P.invalid(str(e), param) from None

    def _encode_waiting(self) -> None:
        """Hand every prompt waiting to be encoded to the tokenizer's thread, as one job."""
        if self._encoding or not self._to_encode:
            return
        batch, self._to_encode = self._to_encode, []
        self._encoding = True
        loop = asyncio.get_running_loop()
        try:
            job = loop.run_in_executor(self.tokenizer_pool, self.llm.encode_each,
                                       [(prompt, tools) for prompt, tools, _ in batch])
        except RuntimeError as e:  # the pool is shut down (the server stops): each request fails with it
            job = loop.create_future()
            job.set_exception(e)
        job.add_done_callback(functools.partial(self._encoded, batch))

    def _encoded(self, batch: list[tuple[Prompt, list | None, asyncio.Future]], job: asyncio.Future) -> None:
        """A job's results to its prompts' requests; the prompts that waited meanwhile go next."""
        self._encoding = False
        failed = None if job.cancelled() else job.exception()  # encode_each returns each prompt's error
        for i, (_, _, future) in enumerate(batch):
            if future.done():
                continue
            if job.cancelled():  # the server is shutting down
                future.cancel()
            elif failed is not None:
                future.set_exception(failed)
            elif isinstance(result := job.result()[i], Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._encode_waiting()

    def chat_prompt(self, body: P.ChatCompletionRequest, functions: list[dict]) -> tuple[list[dict], list | None]:
        """(the messages, the tools for the template) of a chat: the tools rendered by the template
        if it reads them, else written as a system message (tools.py)."""
        messages = [m.as_template_input(self.developer_role, self.reads_tools) for m in body.messages]
        if not functions:
            return messages, None
        if self.reads_tools:
            return messages, [{"type": "function", "function": f} for f in functions]
        return T.with_tools(messages, functions), None

    def check_tool_schemas(self, functions: list[dict]) -> None:
        """400 naming tools when a function's parameters schema does not compile (whatever tool_choice)."""
        try:
            self.llm.engine.grammars.compile(StructuredOutputsParams(json=T.call_schema(functions, "required")))
        except GrammarError as e:
            raise P.invalid(str(e).replace("structured_outputs json", "tools' parameters schema"), "tools") from None

    def samples(self, body: P.RequestBody, prompts: list[list[int]], params: SamplingParams,
                param: str) -> list[tuple[list[int], SamplingParams]]:
        """Each prompt's `n` samples, once the engine's own checks pass for them (a grammar's
        compile among them)."""
        each = params.samples()
        for ids in prompts:
            try:
                self.llm.engine.validate_request(ids, each[0])
            except GrammarError as e:
                raise P.invalid(str(e), body.structured_field) from None
            except RequestError as e:
                raise P.invalid(str(e), param) from None
        return [(ids, sample) for ids in prompts for sample in each]

    def submit(self, work: list[tuple[list[int], SamplingParams]], arrival: float) -> Submission:
        try:
            return self.engine_loop.submit(work, arrival)
        except QueueFull as e:
            raise P.APIError(429, f"{e}: retry later", "rate_limit_error", code="queue_full",
                             headers={"Retry-After": RETRY_AFTER_S}) from None
        except Unavailable as e:
            raise P.APIError(503, str(e), "server_error", code="unavailable",
                             headers={"Retry-After": RETRY_AFTER_S}) from None

    async def respond(self, endpoint: _Endpoint, body: P.RequestBody, prompts: list[list[int]], param: str,
                      request: Request, arrival: float, echo: list[str] | None = None,
                      calls: list[dict] | None = None):
        """Serve `prompts` (token ids), each `body.n` samples; `echo`: each prompt's text, put first in
        its choices' text (and logprobs); `calls`: the functions a chat reply may call (tools.py): a
        reply that is such a call is answered as OpenAI's tool call, streamed as it arrives."""
        params = body.sampling_params(self.max_model_len)
        if params.structured_outputs is None:
            work = self.samples(body, prompts, params, param)
        else:  # compiling a grammar (the first builds the tokenizer's) is not for the event loop's thread
            work = await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, self.samples, body, prompts,
                                                                    params, param)
        P.check_fits(body, max(map(len, prompts)), self.max_model_len)
        submission = self.submit(work, arrival)
        prompt_tokens = sum(map(len, prompts))
        samples = [_Sample(TextStream(self.llm.decode, params.stop), calls=T.CallStream(calls) if calls else None)
                   for _ in work]
        if echo is not None:  # each prompt's `n` samples in turn
            for i, (ids, _) in enumerate(work):
                samples[i].echo = (echo[i // params.n], ids)
        watcher = _abort_on_disconnect(request, self.engine_loop, submission)  # before the stream starts, if ever
        if body.stream:
            return StreamingResponse(self.stream(endpoint, body, submission, samples, prompt_tokens, watcher, calls),
                                     media_type="text/event-stream")
        with _ending(self.engine_loop, submission, watcher):
            choices = [choice async for choice in self.finished_choices(submission, samples)]
        if failed := next((c for c in choices if c.finish_reason == "error"), None):
            raise P.APIError(500, failed.text, "server_error")
        for choice in choices:
            sample = samples[choice.index]
            choice.logprobs = self.logprobs(endpoint, body, sample, choice.token_ids, sample.logprobs)
            choice.text = ("" if sample.echo is None else sample.echo[0]) + choice.text
        choices.sort(key=lambda c: c.index)
        if calls:
            choices = [c.as_call(calls) for c in choices]
        response = endpoint.response(P.new_id(endpoint.kind), body.model, choices, prompt_tokens)
        return P.with_token_ids(response, prompts, choices) if body.return_token_ids else response

    async def finished_choices(self, submission: Submission, samples: list[_Sample]) -> AsyncIterator[P.Choice]:
        while submission.unfinished:
            for update in await submission.next_updates():
                samples[update.index].text.add(update.token_ids)
                samples[update.index].add(update)
                if update.finished:
                    submission.unfinished -= 1
                    yield _choice(update, samples[update.index].text, self.llm)

    def logprobs(self, endpoint: _Endpoint, body: P.RequestBody, sample: _Sample, token_ids: list[int],
                 entries: list) -> dict | None:
        """The response's logprobs of `token_ids` (their TokenLogprobs `entries`), after the prompt's where
        the sample echoes it; None where the body asks for none. Advances the sample's text offset."""
        top = body.top_logprobs_listed
        if top is None:
            return None
        if sample.echo is not None:
            token_ids, entries = sample.echo[1] + token_ids, (sample.prompt_logprobs or []) + entries
        texts = self.llm.token_texts(token_ids)
        tokens = [texts[i] or "" for i in token_ids]
        logprobs = endpoint.logprobs(self.llm, tokens, self.llm.logprob_dicts(entries), top, sample.offset)
        sample.offset += sum(map(len, tokens))
        return logprobs

    async def stream(self, endpoint: _Endpoint, body: P.RequestBody, submission: Submission, samples: list[_Sample],
                     prompt_tokens: int, watcher: asyncio.Task, calls: list[dict] | None = None) -> AsyncIterator[str]:
        """The SSE events of a streamed response; those of the updates taken at once (a step's, or
        several steps' where the stream fell behind) in one piece, one write to the client."""
        # Every chunk's fields before its choices are the same: encoded once. A chunk's JSON is that
        # head, its choices' and its extra fields' (endpoint.chunk puts them after the choices).
        head = _sse(endpoint.chunk(P.new_id(endpoint.kind), body.model, int(time.time()), []))
        head = head[:head.rindex('"choices":') + len('"choices":')]

        def event(choices: list[dict], token_ids: list[int] | None = None, **extra) -> str:
            if body.return_token_ids and token_ids is not None:
                choices[0]["token_ids"] = token_ids
            rest = f",{_json(extra)[1:-1]}" if extra else ""
            return f"{head}{_json(choices)}{rest}}}\n\n"

        def scored(sample: _Sample, update: Update) -> dict | None:
            """The update's tokens' logprobs (the prompt's first where echoed), the echo then spent."""
            logprobs = self.logprobs(endpoint, body, sample, update.token_ids, update.logprobs or [])
            sample.echo = None
            return logprobs

        def with_tools(index: int, piece: T.Piece, finish_reason: str | None = None, **extra) -> list[str]:
            """The chunks of a piece of a reply to a request with tools (tools.py, CallStream): its text,
            or its call's start and arguments' text; the tokens since the last chunk (ids, logprobs) on
            the first, the finish on the last. None for an empty piece of a held reply (its tokens'
            ids and logprobs come with its end) or where the body asks for neither."""
            sample = samples[index]
            if piece.empty and finish_reason is None and (sample.calls.holding or not (
                    body.return_token_ids or body.top_logprobs_listed is not None)):
                return []
            deltas = [P.chat_delta(index, piece.text)] if piece.text else []
            if piece.name is not None:  # OpenAI's first delta of a call: its id and name, no arguments yet
                deltas.append(P.chat_delta(index, tool_calls=[T.tool_call(piece.name, "")]))
            if piece.arguments:
                deltas.append(P.chat_delta(index, tool_calls=[{"function": {"arguments": piece.arguments}}]))
            deltas = deltas or [P.chat_delta(index)]
            deltas[-1]["finish_reason"] = finish_reason
            token_ids, entries = sample.text.token_ids[sample.sent:], sample.logprobs[sample.sent:]
            deltas[0]["logprobs"] = self.logprobs(endpoint, body, sample, token_ids, entries)
            sample.sent = len(sample.text.token_ids)
            return [event([delta], token_ids if i == 0 else None, **(extra if i == len(deltas) - 1 else {}))
                    for i, delta in enumerate(deltas)]

        with _ending(self.engine_loop, submission, watcher):
            if endpoint.role_first:  # a reply that may be a call opens with content null, as OpenAI's calls do
                yield event([P.chat_delta(i, None if calls else "", role="assistant") for i in range(len(samples))])
            completion_tokens = 0
            while submission.unfinished:
                events: list[str] = []
                for update in await submission.next_updates():
                    sample = samples[update.index]
                    sample.add(update)
                    prefix = "" if sample.echo is None else sample.echo[0]  # the first event's: `scored` spends it
                    if not update.finished:
                        if sample.calls is not None:
                            events += with_tools(update.index, sample.calls.feed(sample.text.push(update.token_ids)))
                            continue
                        text = prefix + sample.text.push(update.token_ids)
                        logprobs = scored(sample, update)
                        if text or body.return_token_ids or logprobs is not None:
                            events.append(event([endpoint.delta(update.index, text, logprobs=logprobs)],
                                                update.token_ids))
                        continue
                    submission.unfinished -= 1
                    sample.text.add(update.token_ids)  # a stop string may cut them: the final text decides
                    choice = _choice(update, sample.text, self.llm)
                    completion_tokens += len(choice.token_ids)
                    if choice.finish_reason == "error":
                        events.append(_sse(P.error_body(choice.text, "server_error")))
                        continue
                    extra = {"metrics": P.request_metrics([choice])} if len(samples) == 1 else {}
                    if sample.calls is not None:
                        piece = sample.calls.finish(sample.text.finish(choice.text))
                        events += with_tools(update.index, piece,
                                             "tool_calls" if piece.call else choice.finish_reason, **extra)
                        continue
                    text = prefix + sample.text.finish(choice.text)
                    events.append(event([endpoint.delta(update.index, text, choice.finish_reason,
                                                        scored(sample, update))], update.token_ids, **extra))
                if not submission.unfinished:
                    if body.include_usage:
                        events.append(event([], usage=P.usage(prompt_tokens, completion_tokens)))
                    events.append("data: [DONE]\n\n")
                if events:
                    yield "".join(events)


def create_app(llm: LLM, engine_loop: EngineLoop, metrics: ServerMetrics, settings: Settings) -> FastAPI:
    server, created = OpenAIServer(llm, engine_loop, settings), int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.stop()
        server.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="eagle3-jax", lifespan=lifespan, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    keyed = [Depends(server.check_key)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine_loop.healthy else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": created,
                                            "owned_by": "eagle3-jax", "max_model_len": server.max_model_len}]}

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.check_body(body)
        functions, choice = body.tool_use()
        messages, template_tools = server.chat_prompt(body, functions)
        ids = await server.encode(messages, "messages", template_tools)
        if functions:  # compiling (the first builds the tokenizer's grammar side) is off the event loop's thread
            await asyncio.get_running_loop().run_in_executor(server.tokenizer_pool, server.check_tool_schemas,
                                                             functions)
        calls = functions if choice not in (None, "none") else None
        return await server.respond(CHAT, body, [ids], "messages", request, arrival, calls=calls)

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: P.CompletionRequest, request: Request):
        arrival = time.perf_counter()
        server.check_body(body)
        prompts = body.prompts()
        if not prompts:
            raise P.invalid("prompt is empty", "prompt")
        ids = list(await asyncio.gather(*(server.encode(p, "prompt") for p in prompts)))
        echo = [p if isinstance(p, str) else llm.decode(i) for p, i in zip(prompts, ids)] if body.echo else None
        return await server.respond(COMPLETION, body, ids, "prompt", request, arrival, echo=echo)

    return app


def _choice(update: Update, text: TextStream, llm: LLM) -> P.Choice:
    if update.finish_reason == "error":
        return P.Choice(update.index, update.error or "the request failed", [], "error", update.metrics)
    final = update.text if update.text is not None else llm.decode(text.token_ids)
    return P.Choice(update.index, final, list(text.token_ids), update.finish_reason, update.metrics)


def _json(data) -> str:
    return json.dumps(data, separators=(",", ":"))


def _sse(data: dict) -> str:
    return f"data: {_json(data)}\n\n"


def _abort_on_disconnect(request: Request, engine_loop: EngineLoop, submission: Submission) -> asyncio.Task:
    """A task aborting the submission's unfinished samples when the client hangs up. It also ends
    once the response is complete (the server then reports a disconnect too)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if submission.unfinished:
            engine_loop.abort(submission)

    return asyncio.get_running_loop().create_task(watch())


@contextlib.contextmanager
def _ending(engine_loop: EngineLoop, submission: Submission, watcher: asyncio.Task):
    """Leaving the body, early or not (an error, a closed stream), aborts what is unfinished."""
    try:
        yield
    finally:
        watcher.cancel()
        if submission.unfinished:
            engine_loop.abort(submission)


# ---- errors --------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(P.error_body(*_validation_message(e.errors()), code=None), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        code = "request_too_large" if e.status_code == 413 else None  # BodyLimit's, from a chunked body
        return JSONResponse(P.error_body(str(e.detail), kind, code=code), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(P.error_body("internal error (see the server's log)", "server_error"), status_code=500)


def _validation_message(errors: list[dict]) -> tuple[str, str, str | None]:
    """(message, type, param) of pydantic's first error, naming the field it is about."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", \
            "invalid_request_error", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "missing" and not loc:
        return "the body is empty: send a JSON object", "invalid_request_error", None
    where = ".".join(loc)
    return (f"{where}: {first['msg']}" if where else first["msg"]), "invalid_request_error", (loc or [None])[0]


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413 before it is read whole (by its
    Content-Length, or as its chunks arrive)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is over {self.max_bytes} bytes (--max-request-bytes)"

    async def _too_large(self, scope, receive, send):
        while (await receive()).get("more_body"):
            pass  # read (unparsed) so the client, still sending, gets the answer rather than a reset
        response = JSONResponse(P.error_body(self._message(), "invalid_request_error", code="request_too_large"),
                                status_code=413)
        await response(scope, receive, send)
