"""The OpenAI-compatible HTTP API (FastAPI), as vLLM serves it.

/v1/completions, /v1/chat/completions (both with `stream` as server-sent events), /v1/models, /tokenize,
/detokenize, /health, /version, /metrics; with GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING, /v1/load_lora_adapter and
/v1/unload_lora_adapter (serving_models.py: a request's `model` may name a LoRA adapter). Errors use OpenAI's body
{"error": {"message", "type", "param", "code"}} with vLLM's status codes: 400 (BadRequestError) for invalid
parameters, malformed JSON and over-long prompts, 401 for a bad API key, 404 for an unknown model, 413 for a body
over the size limit, 503 when the waiting queue is full or the server is shutting down. A client that goes away
aborts its requests.

Tokenization and chat templating run on worker threads (preprocess.py), so no request stalls the event loop.
On shutdown the Gate answers 503 to new requests while those in flight drain (serve.py drives it).
"""
import asyncio
import contextlib
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

import graphinfer
from graphinfer.errors import GraphinferError
from graphinfer.outputs import CompletionOutput, Logprob, RequestOutput
from graphinfer.platforms.cpu import release_freed_memory
from graphinfer.runtime.entrypoints.async_llm import (AsyncLLMEngine, EngineDeadError, EngineOverloadedError,
                                                      RequestStream, ServerShuttingDownError)
from graphinfer.server.defaults import DEFAULT_MAX_REQUEST_BODY_BYTES
from graphinfer.server.errors import ERROR_TYPES as _ERROR_TYPES
from graphinfer.server.errors import APIError
from graphinfer.server.metrics import Metrics
from graphinfer.server.preprocess import Preprocessor
from graphinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from graphinfer.server.request_limits import body_error_message, check_chat_template
from graphinfer.server.serving_models import ServingModels, runtime_lora_updating
from graphinfer.server.tool_calling import ToolCalling
from graphinfer.server.tool_parsers import ToolParserManager


def error_response(status: int, message: str, type_: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "HTTPError"),
                                   "param": None, "code": status}}, status_code=status, headers=headers)


class GateState:
    """What the drain reads and sets: whether new requests are refused, and the /v1/* requests in flight."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()


class Gate:
    """A plain ASGI middleware in front of every route. It answers 503 while the server drains (/v1/* and
    /health; /metrics and /version keep answering), 401 for a bad API key on /v1/*, 413 for a body over the
    limit; it counts the /v1/* requests in flight (the drain waits for them) and responses by endpoint and
    status. (Starlette's BaseHTTPMiddleware would hide a client's disconnect from the endpoint.)"""

    def __init__(self, app, state: GateState, api_key: str | None, metrics: Metrics, max_body_bytes: int):
        self.app, self.state, self.api_key, self.metrics, self.max_body_bytes = app, state, api_key, metrics, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        api = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        endpoint = path if api or path in ("/health", "/version", "/metrics") else "other"

        async def refuse(response):
            self.metrics.http(endpoint, response.status_code)
            await response(scope, receive, send)

        state = self.state
        if state.draining and (api or path == "/health"):
            return await refuse(error_response(503, "The server is shutting down and takes no new requests.",
                                               headers={"Connection": "close"}))
        headers = Headers(scope=scope)
        if self.api_key and api and not _key_matches(headers.get("authorization"), self.api_key):
            return await refuse(error_response(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'."))
        # Connection: close, after the body is read and dropped (up to a cap): closing a socket with unread data
        # resets the connection, and a client still uploading (urllib, curl) would see the reset, not the 413.
        too_large = error_response(413, f"The request body is larger than the server's limit of {self.max_body_bytes} "
                                        f"bytes (--max-request-body-bytes).", headers={"Connection": "close"})
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            if int(length) <= _DRAIN_CAP_BYTES:
                await _drain(receive)
            return await refuse(too_large)
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):  # chunked: count as it arrives
            buffered = await self._read_limited(receive)
            if buffered is None:
                await _drain(receive, _DRAIN_CAP_BYTES)
                return await refuse(too_large)
            receive = _replay(buffered, receive)

        started = False

        async def send_counted(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.http(endpoint, message["status"])
            await send(message)

        if api:
            state.in_flight += 1
            state.idle.clear()
        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not started:
                self.metrics.http(endpoint, 500)
            if api:
                state.in_flight -= 1
                if not state.in_flight:
                    state.idle.set()
                    release_freed_memory()  # a large response's objects and JSON, freed: back to the kernel

    async def _read_limited(self, receive) -> list | None:
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body"):
                return messages


def _key_matches(authorization: str | None, api_key: str) -> bool:
    """In constant time (hmac.compare_digest): how much of a guessed key matches must not show in the timing."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {api_key}".encode())


# An over-limit body is read and dropped up to this size before the 413 goes out; a larger one is refused at once
# (the client may then see a reset instead of the answer: a sender of over 64 MiB gets no courtesy read).
_DRAIN_CAP_BYTES = 64 * 2**20


async def _drain(receive, cap: int | None = None) -> None:
    """Read and drop the rest of the request body (at most `cap` more bytes)."""
    size = 0
    while cap is None or size <= cap:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return
        size += len(message.get("body", b""))


def _replay(messages: list, receive):
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
              models: ServingModels | None = None) -> FastAPI:
    """enable_auto_tool_choice / tool_call_parser: vLLM's --enable-auto-tool-choice / --tool-call-parser, which
    tool_choice "auto" needs (tool_calling.py). trust_request_chat_template: vLLM's --trust-request-chat-template,
    without which a request's own chat_template is refused. models: the base model and its LoRA adapters (default:
    the base model alone, named served_model_name)."""
    if tool_call_parser is not None:
        ToolParserManager.get_tool_parser(tool_call_parser)  # an unknown name fails now, not per request
    auto_tool_parser = tool_call_parser if enable_auto_tool_choice else None
    pre = Preprocessor(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        pre.shutdown()
        engine.shutdown()  # after uvicorn stopped taking requests: stop the engine loop, free every request

    app = FastAPI(title="graphinfer", version=graphinfer.__version__, lifespan=lifespan)
    metrics = Metrics(served_model_name)
    metrics.watch_engine(engine)
    metrics.watch_expert_load(engine)
    metrics.watch_eplb(engine)
    metrics.watch_spec_decode(engine)
    app.state.engine, app.state.metrics, app.state.preprocessor = engine, metrics, pre
    app.state.gate = GateState()
    max_model_len = engine.max_model_len
    if models is None:
        models = ServingModels(engine, served_model_name, served_model_name, max_model_len)
    app.state.models = models

    app.add_middleware(Gate, state=app.state.gate, api_key=api_key, metrics=metrics,
                       max_body_bytes=max_request_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_, exc: RequestValidationError):
        msgs = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                f"{str(e.get('msg')).removeprefix('Value error, ')}" for e in exc.errors()]
        return error_response(400, "; ".join(msgs) or "Invalid request body.", "BadRequestError")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_, exc: StarletteHTTPException):  # unknown routes, methods, bodies that are not UTF-8
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's, e.g. not UTF-8
            message = body_error_message(exc.__cause__)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    async def on_api(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.type)

    @app.exception_handler(EngineOverloadedError)
    async def on_overloaded(_, exc: EngineOverloadedError):
        resp = error_response(503, str(exc), "ServiceUnavailableError")
        resp.headers["Retry-After"] = "1"
        return resp

    @app.exception_handler(ServerShuttingDownError)
    async def on_shutting_down(_, exc: ServerShuttingDownError):
        return error_response(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(EngineDeadError)
    async def on_dead(_, exc: EngineDeadError):  # the server is going away (serve.py exits): try elsewhere
        return error_response(503, str(exc), "ServiceUnavailableError")

    @app.exception_handler(GraphinferError)
    async def on_graphinfer(_, exc: GraphinferError):  # the typed errors a user can cause
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(Exception)
    async def on_unexpected(_, exc: Exception):  # a bug: still answer with OpenAI's error body
        return error_response(500, f"Internal server error: {exc!r}", "InternalServerError")

    check_model = models.check  # vLLM's 404 for a name that is neither the base model nor an adapter

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return error_response(503, f"engine loop stopped: {engine.error!r}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": graphinfer.__version__}

    @app.get("/metrics")
    async def prometheus():
        # In a thread: a MoE model's expert load is read from the device (a sync the event loop must not wait on).
        return Response(await asyncio.to_thread(metrics.render), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def show_models():
        return models.show_available_models()

    if runtime_lora_updating():  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: else these routes do not exist (404)
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            # the engine reads the adapter: off the event loop
            return Response(await pre.run(models.load_lora_adapter, req.lora_name, req.lora_path), status_code=200)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            return Response(await pre.run(models.unload_lora_adapter, req.lora_name), status_code=200)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        messages = None if req.messages is None else [m.to_template() for m in req.messages]
        ids, strs = await pre.run(pre.tokenize, req.prompt, messages, req.add_generation_prompt,
                                  req.add_special_tokens, req.return_token_strs, _tool_dicts(req.tools))
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        return {"prompt": await pre.run(pre.detokenize, req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        lora = models.lora_for(req.model)
        params = req.to_sampling_params()
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = engine.submit(await pre.run(pre.completion, req.prompts(), params, rid, req.echo, lora))
        fmt = _CompletionFormat(rid, models.model_name(lora), params, req.echo, req.echo_only, engine.tokenizer,
                                bool(req.return_tokens_as_token_ids))
        if req.stream:
            return _sse(streams, fmt, params, req.include_usage, metrics)
        return await _collect(streams, fmt, raw, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        lora = models.lora_for(req.model)
        params = req.to_sampling_params()
        tools = ToolCalling.for_request(req, auto_tool_parser)
        if tools is not None:
            params = tools.constrain(params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [m.to_template() for m in req.messages]
        check_chat_template(req.chat_template, trust_request_chat_template)
        streams = engine.submit(await pre.run(pre.chat, messages, req.add_generation_prompt, params, rid,
                                              _tool_dicts(req.tools),  # rendered for tool_choice "none" too
                                              req.chat_template, req.chat_template_kwargs, lora))
        fmt = _ChatFormat(rid, models.model_name(lora), params, tools, engine.tokenizer,
                          bool(req.return_tokens_as_token_ids))
        if req.stream:
            return _sse(streams, fmt, params, req.include_usage, metrics)
        return await _collect(streams, fmt, raw, metrics)

    return app


def _tool_dicts(tools) -> list[dict] | None:
    """A request's tools as chat templates read them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


# ----- response bodies -----
# A request of P prompts with n > 1 has P x n choices: prompt p's i-th output is choice p * n + i (vLLM's numbering).

class _CompletionFormat:
    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, rid: str, model: str, params, echo: bool = False, echo_only: bool = False, tokenizer=None,
                 token_ids_as_tokens: bool = False):
        """echo: each choice's text (and, with logprobs, its tokens) starts with its prompt's (RequestOutput.prompt,
        prompt_token_ids, prompt_logprobs); echo_only: max_tokens 0, the prompt alone (the token the engine sampled
        is left out); token_ids_as_tokens: vLLM's return_tokens_as_token_ids, tokens as "token_id:<id>"."""
        self.rid, self.model, self.created, self.params = rid, model, int(time.time()), params
        self.echo, self.echo_only = echo, echo_only
        self.tokenizer, self.token_ids_as_tokens = tokenizer, token_ids_as_tokens

    def head(self, obj: str, choices: list, usage=None) -> dict:
        body = {"id": self.rid, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def token(self, token_id: int, logprob: Logprob | None = None) -> str:
        """A token as logprobs show it: its decoded text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        if self.token_ids_as_tokens:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def logprobs(self, c: CompletionOutput, start: int, offset: int, prompt: RequestOutput | None = None):
        """OpenAI's completion logprobs of c's tokens from `start` on, text offsets from `offset`; prompt: echo, the
        prompt's tokens first (the first with no logprob, as vLLM returns it)."""
        if c.logprobs is None:
            return None
        ids, entries = [], []
        if prompt is not None:
            ids += prompt.prompt_token_ids
            entries += prompt.prompt_logprobs or [None] * len(prompt.prompt_token_ids)
        if not self.echo_only:
            ids += c.token_ids[start:]
            entries += c.logprobs[start:]
        tokens, lps, tops, offsets = [], [], [], []
        n = self.params.logprobs
        for tid, entry in zip(ids, entries):
            if entry is None:
                tok, lp, top = self.token(tid), None, None
            else:
                tok, lp = self.token(tid, entry[tid]), _json_logprob(entry[tid].logprob)
                # the top N plus the token itself, as vLLM returns them
                top = {self.token(t, e): _json_logprob(e.logprob) for t, e in entry.items() if t == tid or e.rank <= n}
            tokens.append(tok)
            lps.append(lp)
            tops.append(top)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def text(self, c: CompletionOutput, out: RequestOutput) -> str:
        """A finished choice's text: its prompt's first when echoed (alone with max_tokens 0)."""
        if not self.echo:
            return c.text
        return (out.prompt or "") + ("" if self.echo_only else c.text)

    def choice(self, index: int, c: CompletionOutput, out: RequestOutput) -> dict:
        body = {"index": index, "text": self.text(c, out),
                "logprobs": self.logprobs(c, 0, 0, out if self.echo else None), "finish_reason": _finish(c),
                "stop_reason": c.stop_reason}
        if out.prompt_logprobs is not None:  # vLLM's extra field (also with echo + logprobs, as there)
            body["prompt_logprobs"] = _json_prompt_logprobs(out.prompt_logprobs)
        return body

    def extra(self, outs: list[RequestOutput]) -> dict:
        """Fields of the response body beyond OpenAI's (chat: prompt_logprobs)."""
        return {}

    def chunk(self, index: int, text: str, c: CompletionOutput, start: int, offset: int, finish: str | None,
              prompt: RequestOutput | None = None) -> dict:
        return self.head(self.chunk_object, [{"index": index, "text": text,
                                              "logprobs": self.logprobs(c, start, offset, prompt),
                                              "finish_reason": finish,
                                              "stop_reason": c.stop_reason if finish else None}])

    def first_chunks(self, n: int) -> list[dict]:
        return []


class _ChatFormat(_CompletionFormat):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, rid: str, model: str, params, tools: ToolCalling | None = None, tokenizer=None,
                 token_ids_as_tokens: bool = False):
        super().__init__(rid, model, params, tokenizer=tokenizer, token_ids_as_tokens=token_ids_as_tokens)
        self.tools, self.tool_streams = tools, {}  # tool_streams: one per streamed choice

    def logprobs(self, c: CompletionOutput, start: int, offset: int, prompt: RequestOutput | None = None):
        if c.logprobs is None:
            return None

        def item(t, e):
            tok = self.token(t, e)
            return {"token": tok, "logprob": _json_logprob(e.logprob), "bytes": list(tok.encode())}

        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            top = sorted(((t, e) for t, e in entry.items() if e.rank <= (self.params.logprobs or 0)),
                         key=lambda te: te[1].rank)
            content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, e) for t, e in top]})
        return {"content": content}

    def choice(self, index: int, c: CompletionOutput, out: RequestOutput) -> dict:
        message, finish = {"role": "assistant", "content": c.text}, _finish(c)
        if self.tools is not None:
            message, finish = self.tools.message(c.text, finish)
        return {"index": index, "message": message, "logprobs": self.logprobs(c, 0, 0), "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def extra(self, outs: list[RequestOutput]) -> dict:
        # vLLM's ChatCompletionResponse.prompt_logprobs (one prompt per chat request)
        plp = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        return {} if plp is None else {"prompt_logprobs": _json_prompt_logprobs(plp)}

    def chunk(self, index: int, text: str, c: CompletionOutput, start: int, offset: int,
              finish: str | None, prompt: RequestOutput | None = None) -> dict | None:
        """None: nothing to send (a tool parser holds the text back)."""
        delta = {"content": text}
        if self.tools is not None:
            stream = self.tool_streams.setdefault(index, self.tools.stream())
            delta, finish = stream.delta(text, finish)
        logprobs = self.logprobs(c, start, offset)
        if not delta and finish is None and logprobs is None:
            return None
        return self.head(self.chunk_object, [{"index": index, "delta": delta, "logprobs": logprobs,
                                              "finish_reason": finish}])

    def first_chunks(self, n: int) -> list[dict]:
        return [self.head(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]) for i in range(n)]


def _json_logprob(logprob: float) -> float:
    """vLLM's clamp: a token the grammar forbids (structured outputs) has logprob -inf, which JSON cannot carry."""
    return max(logprob, -9999.0)


def _json_prompt_logprobs(prompt_logprobs: list) -> list:
    """RequestOutput.prompt_logprobs as vLLM's server returns them: None, then per prompt token {token id: {logprob,
    rank, decoded_token}} (logprobs clamped as _json_logprob does)."""
    return [None if entry is None else
            {str(t): {"logprob": _json_logprob(e.logprob), "rank": e.rank, "decoded_token": e.decoded_token}
             for t, e in entry.items()} for entry in prompt_logprobs]


def _finish(c: CompletionOutput) -> str | None:
    reason = c.finish_reason
    return None if reason is None else ("length" if reason == "length" else "stop")


def _usage(streams: list[RequestStream], completion_tokens: int) -> dict:
    # each prompt counted once, whatever its n (vLLM's usage)
    prompt = sum(s.num_prompt_tokens for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _record(metrics: Metrics, stream: RequestStream, choices: list[CompletionOutput],
            first_token_at: float | None) -> None:
    """A finished request's metrics: one finish per choice, its prompt once, the tokens of all its choices."""
    now = time.monotonic()
    for c in choices:
        metrics.finished(c.finish_reason or "abort")
    metrics.prompt_tokens.inc(stream.num_prompt_tokens)
    metrics.generation_tokens.inc(sum(len(c.token_ids) for c in choices))
    metrics.e2e.observe(now - stream.arrival)
    n = max((len(c.token_ids) for c in choices), default=0)
    if first_token_at is not None:
        metrics.ttft.observe(first_token_at - stream.arrival)
        if n > 1:
            metrics.tpot.observe((now - first_token_at) / (n - 1))


def _close(streams: list[RequestStream], metrics: Metrics) -> None:
    """Abort whatever has not finished (the client went away, or an error) and count it."""
    for s in streams:
        if not s.finished:
            metrics.finished("abort")
            s.abort()


async def _merge(streams: list[RequestStream]):
    """(index, output) from several request streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, None))  # this stream ended: finished or aborted
        except BaseException as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        pending = len(streams)
        while pending:
            i, item = await queue.get()
            if item is None:
                pending -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _collect(streams: list[RequestStream], fmt, raw: Request, metrics: Metrics) -> dict:
    """Wait for every request to finish (aborting them all if the client disconnects)."""
    async def watch():
        while True:
            await asyncio.sleep(0.25)
            if await raw.is_disconnected():
                _close(streams, metrics)
                return

    watcher = asyncio.create_task(watch())
    n = fmt.params.n
    done, first, finals = {}, {}, {}  # done: choice index -> its final CompletionOutput; finals: by prompt
    try:
        async for i, out in _merge(streams):
            first.setdefault(i, time.monotonic())
            for c in out.outputs:  # streamed children come one per output; ranked (best_of) ones all at the end
                if c.finished():
                    done[i * n + c.index] = c
            if out.finished:
                finals[i] = out
                _record(metrics, streams[i], [done[i * n + k] for k in range(n)], first[i])
    finally:
        watcher.cancel()
        _close(streams, metrics)
    choices = [fmt.choice(k, c, finals[k // n]) for k, c in sorted(done.items())]
    body = fmt.head(fmt.object, choices, _usage(streams, sum(len(c.token_ids) for c in done.values())))
    body.update(fmt.extra([finals[i] for i in sorted(finals)]))
    return body


def _sse(streams: list[RequestStream], fmt, params, include_usage: bool, metrics: Metrics) -> StreamingResponse:
    # A stop string is cut from the text only once complete, so text that could still become one is held back.
    hold = max((len(s) for s in params.stop_strings), default=1) - 1
    n = params.n

    async def events():
        sent_text, sent_tokens, first = {}, {}, {}  # by choice index: chars and tokens sent; by prompt: first output
        echoed: dict[int, int] = {}  # echo: by choice index, the length of the prompt text its first chunk carried
        done: dict[int, CompletionOutput] = {}
        try:
            for chunk in fmt.first_chunks(len(streams) * n):
                yield f"data: {json.dumps(chunk)}\n\n"
            async for i, out in _merge(streams):
                first.setdefault(i, time.monotonic())
                for c in out.outputs:
                    k = i * n + c.index
                    # echo: the first chunk carries the prompt (its tokens and logprobs first, as vLLM's)
                    prompt = out if fmt.echo and k not in echoed else None
                    echo = (out.prompt or "") if prompt is not None else ""
                    if prompt is not None:
                        echoed[k] = len(echo)
                    sent, ntok = sent_text.get(k, 0), sent_tokens.get(k, 0)
                    finish = _finish(c)
                    if fmt.echo_only:  # max_tokens 0: the prompt alone, then the finish
                        upto, ntok_now = 0, 0
                    else:
                        upto, ntok_now = (len(c.text) if finish else max(sent, len(c.text) - hold)), len(c.token_ids)
                    if echo or upto > sent or ntok_now > ntok or finish:
                        offset = 0 if prompt is not None else echoed.get(k, 0) + sent
                        chunk = fmt.chunk(k, echo + c.text[sent:upto], c, ntok, offset, finish, prompt)
                        if chunk is not None:
                            yield f"data: {json.dumps(chunk)}\n\n"
                        sent_text[k], sent_tokens[k] = upto, ntok_now
                    if finish:
                        done[k] = c
                if out.finished:
                    _record(metrics, streams[i], [done[i * n + j] for j in range(n)], first[i])
            if include_usage:
                usage = _usage(streams, sum(len(c.token_ids) for c in done.values()))
                yield f"data: {json.dumps(fmt.head(fmt.chunk_object, [], usage))}\n\n"
        except (EngineDeadError, ServerShuttingDownError) as e:  # as vLLM: an error event, then [DONE]
            error = {"message": str(e), "type": _ERROR_TYPES[503], "param": None, "code": 503}
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:  # also when the client disconnects mid-stream (the generator is closed): free its KV blocks
            _close(streams, metrics)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
