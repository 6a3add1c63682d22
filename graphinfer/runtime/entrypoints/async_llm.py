"""AsyncLLMEngine (vLLM's AsyncLLM): the server's engine client. One background thread drives the LLMEngine (the
front end: detokenization, stop strings, logprobs), whose engine core (scheduler, KV cache, model) runs in a process
of its own (engine/core_proc.py) or, for tests, in this one; the asyncio side submits requests and aborts through a
locked inbox and receives each request's outputs on its own queue.

Requests are validated and tokenized on the caller's side (make_requests, which the server runs on a worker thread),
so a bad one is rejected before it is queued, and the HTTP event loop never waits for a model step. On shutdown,
end_all() ends every request still in flight with an error its consumer reports.
"""
import asyncio
import logging
import threading
import time

from graphinfer.errors import GraphinferError, InvalidRequestError
from graphinfer.outputs import RequestOutput
from graphinfer.runtime.entrypoints.input_processor import Request
from graphinfer.runtime.entrypoints.llm_engine import LLMEngine
from graphinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(GraphinferError):
    """The waiting queue is full: the client should retry later (HTTP 503)."""


class EngineDeadError(GraphinferError):
    """The engine loop stopped (an internal error, or a tensor-parallel rank died); the server can no longer
    serve (HTTP 503, and the server exits non-zero)."""


class ServerShuttingDownError(GraphinferError):
    """The server is shutting down: the request was not taken, or was ended before it finished (HTTP 503)."""


class RequestStream:
    """The outputs of one request, as an async iterator. abort() (also safe after it finished) cancels it
    and frees its KV blocks: call it when the client goes away."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, num_prompt_tokens: int, loop):
        self.engine, self.request_id, self.num_prompt_tokens, self.loop = engine, request_id, num_prompt_tokens, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is None:  # aborted while we waited
            raise StopAsyncIteration
        if isinstance(item, ServerShuttingDownError):
            self.finished = True
            raise item
        if isinstance(item, EngineDeadError):
            self.finished = True
            raise item
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineDeadError(f"The engine loop stopped: {item!r}") from item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Call on the event loop that iterates this stream."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
            self.queue.put_nowait(None)  # wake a consumer waiting for an output that will not come


class AsyncLLMEngine:
    """The server's EngineClient (entrypoints/engine_client.py) over an LLMEngine: the server and its metrics use this
    object alone."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 1024):
        self.engine = engine
        self.config, self.tokenizer, self.max_model_len = engine.config, engine.tokenizer, engine.max_model_len
        self.hf_config, self.info, self.startup = engine.hf_config, engine.info, engine.startup
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._new: list = []  # sequences to add
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        self._closed = False  # end_all() ran: no new requests
        self.error: BaseException | None = None
        self.on_dead: list = []  # callbacks(error) once the engine can no longer run (the server then exits)
        # a tensor-parallel rank or a data-parallel replica that dies ends the engine
        engine.on_death(lambda message: self.fail(EngineDeadError(message)))
        self._thread = threading.Thread(target=self._run, name="graphinfer-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def request_limit(self) -> int:
        return self.max_waiting_requests + self.engine.config.scheduler_config.max_num_seqs

    def check_batch_size(self, n: int, best_of: int = 1) -> None:
        """n prompts, each sampled best_of times (parallel sampling: as many sequences run)."""
        if n * best_of > self.request_limit:  # could never be accepted: retrying would not help
            what = f"{n} prompts" if best_of == 1 else f"{n} prompt(s) x {best_of} samples (n / best_of)"
            raise InvalidRequestError(f"{what} in one request exceed the server's limit of {self.request_limit} "
                                      f"requests in flight; send at most {self.request_limit}.")

    # ----- EngineClient -----
    def make_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     lora_request=None) -> Request:
        return self.engine.make_request(prompt, params, request_id, lora_request)

    # LoRA adapters (LLMEngine's; they block while the engine reads an adapter: call them off the event loop)
    def add_lora(self, lora_request) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def tokenize(self, prompt: str) -> list[int]:
        return self.engine.tokenize(prompt)

    def stats(self) -> dict:
        return self.engine.stats()

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        return self.engine.expert_load_summary(ep_size)

    def reset_expert_load(self) -> None:
        self.engine.reset_expert_load()

    def spec_decode_stats(self) -> dict:
        return self.engine.spec_decode_stats()

    def eplb_stats(self) -> dict:
        return self.engine.eplb_stats()

    def on_death(self, callback) -> None:
        self.on_dead.append(lambda error: callback(str(error)))

    def abort_request(self, request_id: str) -> None:
        self.abort(request_id)

    # ----- requests -----
    def make_requests(self, prompts: list, params: SamplingParams, request_ids: list[str],
                      lora_request=None) -> list[Request]:
        """Validate and tokenize every prompt (typed errors; an adapter not read yet is read and checked here); any
        thread may call it."""
        self.check_batch_size(len(prompts))
        return [self.engine.make_request(p, params, rid, lora_request) for p, rid in zip(prompts, request_ids)]

    def submit(self, seqs: list[Request]) -> list["RequestStream"]:
        """Queue validated requests (all or none); call on the event loop. Each returned stream yields that
        request's outputs; the last has finished=True."""
        if not self.healthy:
            raise EngineDeadError(f"The engine loop has stopped: {self.error!r}")
        self.check_batch_size(len(seqs))
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, seq.request_id, seq.num_prompt_tokens, loop) for seq in seqs]
        limit = self.request_limit
        with self._lock:
            if self._closed or self._stopped:
                raise ServerShuttingDownError("The server is shutting down and takes no new requests.")
            if len(self._streams) + len(seqs) > limit:
                raise EngineOverloadedError(f"The server is overloaded ({len(self._streams)} requests in flight, "
                                            f"limit {limit}); retry later.")
            for stream, seq in zip(streams, seqs):
                self._streams[seq.request_id] = stream
                self._new.append(seq)
            self._wake.notify()
        self.engine.wake()
        return streams

    def add_requests(self, prompts: list, params: SamplingParams, request_ids: list[str],
                     lora_request=None) -> list["RequestStream"]:
        """make_requests + submit, on the event loop."""
        return self.submit(self.make_requests(prompts, params, request_ids, lora_request))

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._streams.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._wake.notify()
                self.engine.wake()

    def end_all(self, message: str) -> int:
        """Take no more requests, and end every one in flight: its consumer gets ServerShuttingDownError(message)
        and its KV blocks are freed on the engine loop's next turn. Returns how many were ended."""
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
            self._aborts.extend(s.request_id for s in streams)
            self._wake.notify()
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ServerShuttingDownError(message))
        return len(streams)

    @property
    def kv_blocks_in_use(self) -> int:
        """Over every data-parallel replica, as the engine core last reported."""
        return self.engine.stats()["kv_blocks_in_use"]

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._aborts.extend(self._streams)
            self._wake.notify()
        self.engine.wake()
        self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._lock:
                    while not (self._new or self._aborts or self._stopped or engine.has_unfinished_requests()):
                        self._wake.wait()
                    new, self._new = self._new, []
                    aborts, self._aborts = self._aborts, []
                    stopped = self._stopped
                for req in new:
                    if req.request_id not in aborts:
                        engine.add(req)
                engine.abort_requests(aborts)
                if stopped:
                    return
                outputs = engine.step() if engine.has_unfinished_requests() else []
                for out in outputs:
                    with self._lock:
                        stream = self._streams.get(out.request_id)
                        if stream is not None and out.finished:
                            del self._streams[out.request_id]
                    if stream is not None:
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except BaseException as e:  # a bug, or a rank gone: fail every request loudly instead of hanging them
            logger.exception("engine loop died")
            dead = engine.dead
            self.fail(EngineDeadError(f"{dead}: {e}") if dead else e)

    def fail(self, error: BaseException) -> None:
        """The engine can no longer run: end every request with `error` and tell the on_dead callbacks (once)."""
        with self._lock:
            first, self.error = self.error is None, self.error or error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self.error)
        if first:
            for callback in self.on_dead:
                callback(self.error)
