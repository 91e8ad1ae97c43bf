"""The public Python surface: `LLM`, `SamplingParams`, `RequestOutput`.

    from eagle3_jax import LLM, SamplingParams
    llm = LLM()                                   # SmolLM2-135M-Instruct + our EAGLE-3 drafter
    out = llm.chat([{"role": "user", "content": "Why is the sky blue?"}], SamplingParams(max_tokens=64))[0]
    print(out.text, out.metrics.acceptance_length)

As in vLLM, `chat` applies the chat template (the drafter was trained on it) and `generate` takes
raw text or token ids; chat messages ({"role", "content"} dicts) are templated wherever passed.

Logprobs as vLLM returns them: `SamplingParams(logprobs=N)` gives each sample's
`CompletionOutput.logprobs`, one dict per generated token, and `prompt_logprobs=N` the output's
`RequestOutput.prompt_logprobs`, one per prompt token (None for the first); each dict maps token id
-> `Logprob(logprob, rank, decoded_token)`: the token itself first (its rank among all, 1 the
likeliest), then the N likeliest (ranks 1..N), the token not listed twice. The values are the
target's log-softmax before temperature, top-k, top-p and min-p, computed in the same programs as
the tokens (the verify's logits; the prefill's for the prompt).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax import assets
from eagle3_jax.config import EngineConfig, ModelConfig, TreeSpec, parse_tree
from eagle3_jax.engine.engine import Engine
from eagle3_jax.engine.scheduler import Request, RequestError, RequestMetrics, TokenLogprobs
from eagle3_jax.parallel import sharding
from eagle3_jax.runner.target import target_model_for
from eagle3_jax.sampling_params import SamplingParams
from eagle3_jax.weights.eagle3 import load_drafter
from eagle3_jax.weights.llama import load_llama

Prompt = str | Sequence[dict] | Sequence[int]


@dataclasses.dataclass
class Logprob:
    """One token's log-probability under the target, its rank (1: the likeliest; ties count as
    ahead) and its text decoded alone (None without a tokenizer), as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per token a dict token id -> Logprob (the module docstring); the prompt's first token has None.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (`SamplingParams.n` of them); `logprobs` (one dict per token of
    `token_ids`) and `cumulative_logprob` (their tokens' sum) where SamplingParams.logprobs is set."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None
    metrics: RequestMetrics
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """A prompt's samples in `outputs`; the fields beside it are those of the first sample.
    `prompt_logprobs`: one entry per prompt token where SamplingParams.prompt_logprobs is set."""

    request_id: int | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None

    @classmethod
    def of(cls, prompt_token_ids: list[int], outputs: list[CompletionOutput], request_id: int | None = None,
           prompt_logprobs: PromptLogprobs | None = None) -> RequestOutput:
        first = outputs[0]
        return cls(request_id, prompt_token_ids, first.token_ids, first.text, first.finish_reason, first.error,
                   first.metrics, outputs, prompt_logprobs)


@dataclasses.dataclass
class StreamDelta:
    token_ids: list[int]  # tokens accepted since the previous delta
    text: str  # their text
    finished: bool
    output: RequestOutput | None  # set on the last delta
    logprobs: SampleLogprobs | None = None  # the tokens' where SamplingParams.logprobs is set


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, so a second start loads executables instead of
    compiling them (kept under the asset cache unless the user configured a directory). Every
    program is kept, however fast it compiled (JAX keeps those over 1 s by default): a start
    otherwise compiles the few dozen small ones again, one after another (unless the user set
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS). The engine's fused programs are kept beside it
    (runner/executables.py)."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(assets.cache_dir() / "xla"))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def default_dtype():
    """bf16 on accelerators; f32 on the CPU, where tests compare against f32 references."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """Token ids -> text, special tokens skipped: the tokenizers library's decode where that is what
    the transformers tokenizer returns (a fast one that cleans up no spaces), else the tokenizer's.
    transformers' wrapper costs several times the decode itself, and the server decodes each
    streamed update of each reply (serve/detokenize.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Codec:
    """The text side of a target: its tokenizer and chat template, prompts to token ids and tokens
    to text, no engine (`LLM` is one; the server's HTTP process has one alone, over `load_tokenizer`).
    `tokenizer`: a transformers tokenizer, or None (token ids only)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token id -> its text decoded alone (`token_texts`)
        self._byte_decoder: dict[str, int] | None = None  # a byte-level BPE's character -> byte (`token_bytes`)
        self._decode = _text_decoder(tokenizer)

    def encode(self, prompt: Prompt, tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of a prompt: raw text tokenized as it is (with the tokenizer's special tokens,
        a BOS where it adds one), chat messages templated (`tools`, OpenAI's function definitions,
        passed to a template that renders them), token ids as they are. Raises RequestError for an
        empty or unusable prompt."""
        kind = self._prompt_kind(prompt)
        if kind == "text":
            return list(self.tokenizer(prompt).input_ids)
        if kind == "chat":
            return list(self.tokenizer.apply_chat_template(list(prompt), tools=list(tools) if tools else None,
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return [operator.index(t) for t in prompt]

    def encode_each(self, prompts: Sequence[tuple[Prompt, Sequence[dict] | None]]) -> list[list[int] | Exception]:
        """`encode` of each (prompt, tools): its ids, or the exception `encode` raises for it. The
        raw texts are tokenized in one call and the conversations without tools templated in one:
        the tokenizers library tokenizes a batch in Rust with the GIL released (on several threads
        where there are cores), where one call each holds it throughout. The ids are those of
        `encode` one at a time (the batched call renders and tokenizes each the same way); where a
        batched call fails, each of its prompts is encoded alone, so only a bad one fails."""
        results: list[list[int] | Exception | None] = [None] * len(prompts)
        batches: dict[str, list[int]] = {"text": [], "chat": []}
        for i, (prompt, tools) in enumerate(prompts):
            try:
                kind = self._prompt_kind(prompt)
            except RequestError as e:
                results[i] = e
                continue
            if kind in batches and not (kind == "chat" and tools):
                batches[kind].append(i)
        for kind, indices in batches.items():
            if len(indices) < 2:
                continue
            batch = [prompts[i][0] for i in indices]
            try:
                ids = (self.tokenizer(batch).input_ids if kind == "text" else self.tokenizer.apply_chat_template(
                    [list(m) for m in batch], add_generation_prompt=True, tokenize=True, return_dict=False))
            except Exception:  # noqa: BLE001 - each prompt alone below: the bad one fails with its own error
                continue
            for i, one in zip(indices, ids):
                results[i] = list(one)
        for i, (prompt, tools) in enumerate(prompts):
            if results[i] is None:
                try:
                    results[i] = self.encode(prompt, tools)
                except Exception as e:  # noqa: BLE001 - its caller raises it, as `encode` would have
                    results[i] = e
        return results

    def _prompt_kind(self, prompt: Prompt) -> str:
        """How `encode` reads a prompt: "text", "chat" (messages) or "ids"; RequestError where it
        cannot (empty, malformed, text without a tokenizer)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("prompt is empty")
            if self.tokenizer is None:
                raise RequestError("this target has no tokenizer: pass token ids")
            return "text"
        if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__len__") or not hasattr(prompt, "__iter__"):
            raise RequestError(f"{_BAD_PROMPT}, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise RequestError("prompt is empty")
        if all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise RequestError(f"chat message {i} needs a 'role' and a 'content', both strings")
            if self.tokenizer is None:
                raise RequestError("this target has no tokenizer: pass token ids")
            return "chat"
        if not all(_is_token_id(t) for t in prompt):
            kinds = sorted({type(t).__name__ for t in prompt if not _is_token_id(t)})
            raise RequestError(f"{_BAD_PROMPT}; got a list holding {', '.join(kinds)}")
        return "ids"

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self._decode(list(token_ids))

    def token_texts(self, token_ids: Iterable[int]) -> dict[int, str | None]:
        """Each token id's text decoded alone, special tokens as written (vLLM's `decoded_token`);
        None without a tokenizer."""
        token_ids = set(token_ids)
        if self.tokenizer is None:
            return dict.fromkeys(token_ids)
        if missing := sorted(token_ids - self._token_texts.keys()):
            self._token_texts.update(zip(missing, self.tokenizer.batch_decode([[i] for i in missing])))
        return {i: self._token_texts[i] for i in token_ids}

    def token_bytes(self, token_ids: Iterable[int]) -> dict[int, list[int]]:
        """Each token id's own bytes (OpenAI's logprobs `bytes`): a byte-level BPE token's (Llama 3's,
        SmolLM2's), so that a character split over tokens is whole again where they are joined;
        another tokenizer's, its text's UTF-8."""
        token_ids = sorted(set(token_ids))
        texts = self.token_texts(token_ids)
        own = {i: list((texts[i] or "").encode()) for i in token_ids}
        if self.tokenizer is None or not _byte_level(self.tokenizer):
            return own
        if self._byte_decoder is None:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        for i, piece in zip(token_ids, self.tokenizer.convert_ids_to_tokens(token_ids)):
            if piece is not None and all(c in self._byte_decoder for c in piece):
                own[i] = [self._byte_decoder[c] for c in piece]
        return own

    def logprob_dicts(self, entries: Sequence[TokenLogprobs | None]) -> list[dict[int, Logprob] | None]:
        """The engine's logprobs of some tokens as vLLM's dicts (the module docstring); None stays None."""
        texts = self.token_texts(i for e in entries if e is not None for i in (e.token, *e.top_ids))
        dicts = []
        for e in entries:
            if e is None:
                dicts.append(None)
                continue
            d = {e.token: Logprob(e.logprob, e.rank, texts[e.token])}
            for rank, (i, logprob) in enumerate(zip(e.top_ids, e.top_logprobs), 1):
                d.setdefault(i, Logprob(logprob, rank, texts[i]))
            dicts.append(d)
        return dicts

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the chat template, ready for the assistant's turn;
        `tools` (OpenAI's function definitions) for a template that renders them."""
        if isinstance(messages, str) or not _is_conversation(messages):
            raise RequestError("chat takes a conversation: a non-empty list of {'role', 'content'} dicts "
                               "(LLM.generate takes raw text)")
        return self.encode(messages, tools)


class LLM(Codec):
    """An EAGLE-3 engine over a Hugging Face Llama target and an optional drafter.

    target: a directory with config.json, safetensors and optionally tokenizer files, or a Hugging
        Face hub id ("org/name", through huggingface_hub's cache; HF_HUB_OFFLINE=1: the cache only);
        None: the default, SmolLM2-135M-Instruct, prepared on first use.
    draft: a drafter in the public EAGLE-3 layout, or a hub id; "default": the shipped drafter for
        the default target; None: the target alone.
    revision: the target's hub revision (branch, tag or commit; default main).
    warmup: compile every program first (True) or each on first use (False); None: on accelerators
        only, where "auto" speculation times each bucket (on the CPU all shapes take minutes).
    engine_config: what the engine serves (EngineConfig()); the engine settles what it leaves open
        once, for the target, the drafter and the device (runner/served.py). Each of the arguments
        below, and any EngineConfig field passed by name (`max_model_len=...`), replaces its field:
    num_speculative_tokens: K, the chain's proposals (0: the target alone).
    speculator, batch_invariant: EngineConfig's fields (None: engine_config's); "ngram" needs no
        drafter (a "default" draft is then None).
    tree: EngineConfig.tree as a TreeSpec or "steps,top_k,tokens" (as `--tree` takes it); "auto":
        engine_config's tree, else `config.default_tree`'s; None or "none": the chain only.
    gpu_memory_utilization: EngineConfig.kv_memory_fraction (None: engine_config's).
    """

    def __init__(self, target: str | Path | None = None, draft: str | Path | None = "default",
                 num_speculative_tokens: int = 3, dtype=None, engine_config: EngineConfig | None = None,
                 tensor_parallel_size: int = 1, warmup: bool | None = None, progress: bool = True,
                 tree: TreeSpec | str | None = "auto", batch_invariant: bool | None = None,
                 speculator: str | None = None, gpu_memory_utilization: float | None = None,
                 revision: str | None = None, **engine_fields):
        given = dict(speculator=speculator, batch_invariant=batch_invariant, kv_memory_fraction=gpu_memory_utilization)
        fields = {name: value for name, value in given.items() if value is not None}
        tree = parse_tree(tree)
        engine_config = engine_config or EngineConfig()
        if tree != "auto" or not isinstance(engine_config.tree, TreeSpec):  # "auto" keeps a tree the config names
            fields["tree"] = tree
        # Checked now, before anything loads.
        engine_config = dataclasses.replace(engine_config, num_speculative_tokens=num_speculative_tokens, **fields,
                                            **engine_fields)
        enable_compilation_cache()
        if target is None:
            target = assets.prepare_default_target(progress=progress)
        target = assets.resolve_model(target, revision)
        if draft == "default":
            shipped = target.resolve() == assets.DEFAULT_TARGET.resolve() and engine_config.speculator == "eagle3"
            draft = assets.DEFAULT_DRAFT if shipped else None
        elif draft is not None:
            draft = assets.resolve_model(draft, drafter=True)
        dtype = dtype or default_dtype()
        mesh = place = None
        if tensor_parallel_size > 1:
            mesh = sharding.make_mesh(tensor_parallel_size)
            # Each tensor goes straight to its shards: a 70B target never sits whole on one device.
            target_cfg = ModelConfig.from_json(target / "config.json")
            specs = target_model_for(target_cfg).param_specs(target_cfg, tensor_parallel_size)
            place = sharding.make_place(mesh, specs)
        cfg, params = load_llama(target, dtype, place=place)
        draft_cfg = draft_params = None
        if draft is not None:
            draft_cfg, draft_params = load_drafter(draft, cfg, dtype)
            if draft_cfg.capture_layer_ids is not None:  # the drafter was trained on these layers
                cfg = cfg.with_capture_layers(draft_cfg.capture_layer_ids)
        self.target = target  # the resolved directory
        Codec.__init__(self, load_tokenizer(target))
        eos = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.engine = Engine(cfg, params, draft_cfg, draft_params, engine_config, eos_token_ids=sorted(eos),
                             detokenize=self.decode if self.tokenizer is not None else None, mesh=mesh,
                             tokenizer=self.tokenizer)
        if warmup or (warmup is None and jax.default_backend() != "cpu"):
            self.engine.warmup(progress=progress)

    def close(self) -> None:
        """Release the device memory now (KV pool, weights, buffers), ending unfinished requests;
        `with LLM(...) as llm:` closes on leaving the block. Dropping the last reference frees it too."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams | dict] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, with `n` samples each in `.outputs`. Prompts are
        raw text or token ids, as they are (no chat template: `chat` applies it).

        `sampling_params` is one SamplingParams for all, or one per prompt: a SamplingParams or a
        dict of its fields (a request payload, validated here). A bad request gets finish_reason
        "error" and its message in `.error`; the others are served as usual.
        """
        if not _is_batch(prompts):
            prompts = [prompts]
        return self._generate(prompts, sampling_params, use_tqdm, self.encode)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams | dict] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """`generate` for one conversation (a list of {"role", "content"} dicts) or a list of
        them, each through the target's chat template."""
        if isinstance(messages, str):
            raise TypeError("chat takes a conversation, a list of {'role', 'content'} dicts, or a list of them "
                            "(LLM.generate takes raw text)")
        conversations = [messages] if _is_conversation(messages) else messages
        return self._generate(conversations, sampling_params, use_tqdm, self.encode_chat)

    def _generate(self, prompts, sampling_params, use_tqdm, encode) -> list[RequestOutput]:
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or len(prompts) == 0:
            raise ValueError("no prompts: pass a prompt or a non-empty list of prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        groups = [self._add_samples(prompt, params, encode) for prompt, params in zip(prompts, sampling_params)]
        self.engine.run([r for g in groups if isinstance(g, list) for r in g], progress=use_tqdm)
        return [g if isinstance(g, RequestOutput) else self._group_output(g) for g in groups]

    def generate_iter(self, requests: Iterable[tuple[Prompt, SamplingParams | dict]],
                      max_waiting: int | None = None) -> Iterator[tuple[int, RequestOutput]]:
        """Continuous batching over (prompt, sampling params): yields (index in `requests`, output) as
        requests finish. Requests are pulled while fewer than `max_waiting` (default max_num_seqs)
        wait, so finished rows refill at once; a bad request comes back at once with "error"."""
        limit = max_waiting or self.engine.cfg.max_num_seqs
        source = enumerate(requests)
        live: dict[int, int] = {}  # engine request id -> index in `requests`
        samples: dict[int, list[Request]] = {}  # index in `requests` -> its samples
        exhausted = False
        while True:
            while not exhausted and self.engine.num_waiting < limit:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                i, (prompt, params) = item
                added = self._add_samples(prompt, params, self.encode)
                if isinstance(added, RequestOutput):
                    yield i, added
                else:
                    samples[i] = added
                    live.update((r.id, i) for r in added)
            if not self.engine.has_unfinished():
                if exhausted:
                    return
                continue
            for req in self.engine.step():
                if req.finished and req.id in live:
                    i = live.pop(req.id)
                    if all(r.finished for r in samples[i]):
                        yield i, self._group_output(samples.pop(i))

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield tokens as they are accepted (a few per iteration); the last delta has the output."""
        params = sampling_params or SamplingParams()
        if params.n > 1:
            raise ValueError(f"stream yields one sample; got n={params.n} (generate returns n samples)")
        req = self._add(prompt, params, self.encode)
        if isinstance(req, RequestOutput):  # refused: one delta carrying the error, as generate returns it
            yield StreamDelta([], "", True, req)
            return
        seen = 0
        while not req.finished:
            self.engine.step()
            if len(req.output) > seen or req.finished:
                new = req.output[seen:]
                logprobs = None if req.logprobs is None else self.logprob_dicts(req.logprobs[seen:len(req.output)])
                seen = len(req.output)
                yield StreamDelta(new, self.decode(new), req.finished, self._output(req) if req.finished else None,
                                  logprobs)
        while self.engine.has_unfinished() and not self.engine.num_running and not self.engine.num_waiting:
            self.engine.step()  # drain the surplus iteration so the engine is idle again

    def _add(self, prompt: Prompt, params: SamplingParams | dict, encode) -> Request | RequestOutput:
        """Queue one single-sample request, or its error output when the engine refuses it."""
        added = self._add_samples(prompt, params, encode)
        return added if isinstance(added, RequestOutput) else added[0]

    def _add_samples(self, prompt: Prompt, params: SamplingParams | dict, encode) -> list[Request] | RequestOutput:
        """Queue a prompt's `n` samples, or its error output when the engine refuses it (then none
        is queued: every sample is the same request)."""
        try:
            if not isinstance(params, SamplingParams):
                params = SamplingParams(**params)
            ids = encode(prompt)
            samples = params.samples()
            for sample in samples:
                self.engine.validate_request(ids, sample)
            return [self.engine.add_request(ids, sample) for sample in samples]
        except (RequestError, ValueError, TypeError) as e:
            return self._error_output(prompt, str(e))

    def completion(self, req: Request, index: int = 0) -> CompletionOutput:
        """A finished request as one sample of its prompt's output."""
        text = req.text if req.text is not None else self.decode(req.output)
        logprobs = cumulative = None
        if req.logprobs is not None:
            logprobs = self.logprob_dicts(req.logprobs)
            cumulative = float(sum(e.logprob for e in req.logprobs))
        return CompletionOutput(index, text, list(req.output), req.finish_reason, req.error, req.metrics, logprobs,
                                cumulative)

    def _output(self, req: Request) -> RequestOutput:
        return self._group_output([req])

    def _group_output(self, samples: list[Request]) -> RequestOutput:
        outputs = [self.completion(req, i) for i, req in enumerate(samples)]
        first = samples[0]
        prompt_logprobs = None if first.prompt_logprobs is None else self.logprob_dicts(first.prompt_logprobs)
        return RequestOutput.of(first.prompt, outputs, first.id, prompt_logprobs)

    def _error_output(self, prompt: Prompt, message: str) -> RequestOutput:
        token_ids = isinstance(prompt, (list, tuple)) and all(map(_is_token_id, prompt))
        ids = [operator.index(t) for t in prompt] if token_ids else []
        return RequestOutput.of(ids, [CompletionOutput(0, "", [], "error", message, RequestMetrics())])


_BAD_PROMPT = "a prompt is a string, chat messages (a list of {'role', 'content'} dicts) or token ids (a list of ints)"


def _is_token_id(t) -> bool:
    """An integer scalar (a NumPy or 0-d array one too), not a bool: what `operator.index` takes.
    A 1-d array has `__index__` as well, but raises on it."""
    if isinstance(t, bool):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def _is_conversation(messages) -> bool:
    """A non-empty list of dicts: one conversation (each message checked by `encode`)."""
    return (isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and len(messages) > 0
            and all(isinstance(m, dict) for m in messages))


def _is_batch(prompts) -> bool:
    """Whether `generate` got a list of prompts (strings, lists, 1-d arrays) rather than one prompt
    (chat messages or token ids, checked by `encode`)."""
    if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence):
        return False
    return all(isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, bytes))
               or getattr(p, "ndim", None) == 1 for p in prompts)


def _byte_level(tokenizer) -> bool:
    """Whether a (fast) tokenizer's tokens are byte-level BPE pieces (GPT-2's byte-to-character map)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


def load_tokenizer(directory: Path):
    """A target directory's tokenizer (with its chat template), None where it has no tokenizer files."""
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
