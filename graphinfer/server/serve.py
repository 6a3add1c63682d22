"""`graphinfer serve ART_OR_MODEL`: start the engine (from an artifact, or compiling the model in memory) and
serve the OpenAI-compatible API with uvicorn.

- The port is bound before the model loads: a busy port is one error line and a non-zero exit, at once.
  The banner (with copy-paste examples naming this interpreter by absolute path) prints once it is serving.
- SIGTERM / SIGINT drain: new requests get 503 while those in flight run to their end, for up to
  --shutdown-timeout seconds; then every remaining stream ends with an error event and [DONE] (a non-streaming
  request gets a 503), the engine stops, its KV blocks are all free, and the process exits 0.
  A second signal ends the drain at once.
- A dead engine (a tensor-parallel rank that exits, or the engine loop on an error) ends the server: requests
  get 503 for a second, then it exits non-zero, naming the cause.
- Tensor parallel: only node rank 0 serves; other nodes run workers (cli.py).
- LoRA (--enable-lora --lora-modules NAME=PATH ...): each adapter is read and checked before the server answers;
  one the engine refuses ends the start-up with its message (serving_models.py).
"""
import asyncio
import contextlib
import errno
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time

import uvicorn

from graphinfer.errors import GraphinferError
from graphinfer.server.api_server import build_app
from graphinfer.server.errors import APIError
from graphinfer.server.serving_models import LoRAModulePath, ServingModels
from graphinfer.runtime.startup_timer import seconds_since_process_start
from graphinfer.runtime.entrypoints.async_llm import AsyncLLMEngine
from graphinfer.server.defaults import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_SHUTDOWN_TIMEOUT,
                                        resolve_serve_engine_args)

logger = logging.getLogger(__name__)

_DEAD_ENGINE_GRACE_S = 1.0  # a dead engine: how long clients still get their 503 before the server exits


def is_artifact(path: str) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "manifest.json"))


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening (so a second server on the port fails at once, not after loading
    its model; a client that connects while the model loads waits in the backlog until the server answers)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart ignores TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise GraphinferError(_bind_error(host, port, e)) from None
    sock.set_inheritable(True)
    return sock


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"cannot serve on {host}:{port}: the address is already in use (another server?); stop it or pick " \
               f"another --port."
    return f"cannot serve on {host}:{port}: {e.strerror or e}; check --host and --port."


def banner(name: str, host: str, port: int, api_key: str | None, has_tokenizer: bool = True) -> str:
    """What `graphinfer serve` prints once it answers: the URL, and examples that work pasted into any shell
    (this interpreter and this graphinfer by absolute path; token-id prompts for a model without a tokenizer)."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    base = f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/v1"
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    python = shlex.quote(sys.executable)
    script = os.path.join(os.path.dirname(sys.executable), "graphinfer")
    cli = shlex.quote(script if os.path.exists(script) else os.path.abspath(sys.argv[0]))
    if has_tokenizer:
        route, body = "chat/completions", f'"messages": [{{"role": "user", "content": "Hello!"}}]'
        prompt = "'The capital of France is'"
    else:
        route, body, prompt = "completions", '"prompt": [1, 2, 3]', "[1, 2, 3]"
    bench = "" if api_key else \
        f"  {cli} bench serve --url {base[:-3]} --concurrency 1,4 --num-prompts 8 --max-tokens 16\n"
    return f"""
graphinfer is serving {name!r} at {base}   (Ctrl-C or SIGTERM: drain, then stop)
  curl {base}/{route}{auth} -H "Content-Type: application/json" \\
    -d '{{"model": "{name}", {body}, "max_tokens": 32}}'
  {python} -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='{api_key or 'EMPTY'}'); \\
print(c.completions.create(model='{name}', prompt={prompt}, max_tokens=16).choices[0].text)"
{bench}"""


class _Server(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM / SIGINT instead of its fixed grace period, and a banner."""

    def __init__(self, config: uvicorn.Config, app, shutdown_timeout: float, on_started):
        super().__init__(config)
        self.app, self.shutdown_timeout, self.on_started = app, shutdown_timeout, on_started
        self.loop: asyncio.AbstractEventLoop | None = None
        self.signals = 0
        self.stop_now = asyncio.Event()
        self.drained = None  # (finished, ended at the timeout) once the drain ran
        self.drain_task: asyncio.Task | None = None
        self.engine_error: BaseException | None = None

    def engine_died(self, error: BaseException) -> None:
        """The engine can no longer run (a tensor-parallel rank died, or its loop did): requests get 503 for a
        moment (AsyncLLMEngine.fail ended those in flight), then the server stops and serve() exits non-zero."""
        self.engine_error = error
        if self.loop is None or not self.started:
            self.should_exit = True
        else:
            self.loop.call_soon_threadsafe(self.loop.call_later, _DEAD_ENGINE_GRACE_S, self._exit_now)

    def _exit_now(self) -> None:
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            await super().startup(sockets)
        except OSError as e:  # listen() failed: another process bound the same port meanwhile
            sock = (sockets or [None])[0]
            host, port = sock.getsockname()[:2] if sock is not None else ("?", 0)
            raise GraphinferError(_bind_error(host, port, e)) from None
        if self.started:
            self.on_started()

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's, but it does not re-raise the signal at the end: a drained shutdown exits with status 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals += 1
        if self.loop is None or not self.started:  # still starting: nothing is in flight
            self.should_exit = True
        elif self.signals == 1:
            self.loop.call_soon_threadsafe(self._start_drain)
        elif self.signals == 2:
            self.loop.call_soon_threadsafe(self.stop_now.set)
        else:
            self.force_exit = True

    def _start_drain(self) -> None:
        self.drain_task = self.loop.create_task(self._drain_then_exit())  # kept: the loop holds tasks weakly

    async def _drain_then_exit(self) -> None:
        try:
            self.drained = await drain(self.app, self.shutdown_timeout, self.stop_now)
        except Exception:  # never let a failed drain keep the server up
            logger.exception("drain failed")
        finally:
            self.should_exit = True


async def drain(app, timeout: float, stop_now: asyncio.Event) -> tuple[int, int]:
    """Refuse new requests (503), wait up to `timeout` s for those in flight, then end the rest with an error.
    Returns (requests that finished during the drain, requests ended at the timeout)."""
    gate, engine = app.state.gate, app.state.engine
    gate.draining = True
    in_flight = gate.in_flight
    print(f"graphinfer: shutting down: new requests get 503; waiting up to {timeout:g} s for {in_flight} in flight "
          f"(a second Ctrl-C / SIGTERM ends them now)", flush=True)
    waiters = [asyncio.ensure_future(gate.idle.wait()), asyncio.ensure_future(stop_now.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
    remaining = gate.in_flight
    if remaining:
        why = ("a second Ctrl-C / SIGTERM ended the drain before the request finished" if stop_now.is_set() else
               f"the request did not finish within the shutdown timeout ({timeout:g} s)")
        engine.end_all(f"The server is shutting down: {why}, so it was ended.")
        with contextlib.suppress(asyncio.TimeoutError):  # their error events / 503s go out
            await asyncio.wait_for(gate.idle.wait(), 10)
    return in_flight - remaining, remaining


def serve(target: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
          max_waiting_requests: int, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
          max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, enable_auto_tool_choice: bool = False,
          tool_call_parser: str | None = None, trust_request_chat_template: bool = False,
          lora_modules: list[LoRAModulePath] | None = None, **engine_args) -> None:
    """lora_modules: vLLM's --lora-modules, the adapters served from the start (needs enable_lora)."""
    from graphinfer.engine_args import create_engine_config
    from graphinfer.runtime.entrypoints.llm_engine import LLMEngine
    from graphinfer.server.tool_parsers import ToolParserManager

    if enable_auto_tool_choice and tool_call_parser is None:  # as vLLM
        raise GraphinferError(f"--enable-auto-tool-choice requires --tool-call-parser (one of "
                              f"{', '.join(sorted(ToolParserManager.tool_parsers))}).")
    if tool_call_parser is not None:
        ToolParserManager.get_tool_parser(tool_call_parser)
    if shutdown_timeout < 0:
        raise GraphinferError(f"--shutdown-timeout {shutdown_timeout} must be >= 0 (seconds).")
    if max_request_body_bytes < 1:
        raise GraphinferError(f"--max-request-body-bytes {max_request_body_bytes} must be >= 1.")
    sock = bind_socket(host, port)  # before the model loads: a busy port fails now, in one line
    engine = None
    try:
        engine_args = resolve_serve_engine_args(engine_args)
        engine_args.update({"artifact": target} if is_artifact(target) else {"model": target})
        # the engine core (scheduler, model) in a process of its own: HTTP, detokenization and the step loop do not
        # share one interpreter lock (vLLM v1's AsyncLLM + EngineCore)
        config = create_engine_config(engine_args)
        if lora_modules and not config.lora_config.enable_lora:  # before the model loads (vLLM fails at start too)
            raise GraphinferError(f"--lora-modules ({', '.join(m.name for m in lora_modules)}) needs --enable-lora: "
                                  f"LoRA is not enabled. Use --enable-lora to enable LoRA.")
        engine = LLMEngine(config, core_process=True)
        name = served_model_name or _model_name(engine.config.model_config.model)
        async_engine = AsyncLLMEngine(engine, max_waiting_requests)
        models = ServingModels(async_engine, name, target or engine.config.model_config.model, engine.max_model_len)
        try:
            models.load_static(lora_modules or [])
        except APIError as e:
            raise GraphinferError(f"--lora-modules: {e.message}") from None
        app = build_app(async_engine, name, api_key, max_request_body_bytes, enable_auto_tool_choice, tool_call_parser,
                        trust_request_chat_template, models)
        logger.info("serving with max_num_batched_tokens=%d, max_num_seqs=%d",
                    engine.config.scheduler_config.max_num_batched_tokens, engine.config.scheduler_config.max_num_seqs)
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        engine_ready = time.perf_counter()

        def on_started():
            engine.startup.record("server ready", time.perf_counter() - engine_ready)
            if (since_start := seconds_since_process_start()) is not None:
                engine.startup.record("serving (process start to server ready)", since_start)
            print(banner(name, host, port, api_key, engine.tokenizer is not None), flush=True)

        server = _Server(config, app, shutdown_timeout, on_started=on_started)
        async_engine.on_dead.append(server.engine_died)
        t0 = time.monotonic()
        server.run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.shutdown()
            kv_blocks_in_use = engine.stats()["kv_blocks_in_use"]
    if server.engine_error is not None:
        raise GraphinferError(f"the engine stopped ({server.engine_error}); the server answered 503 and exited. "
                              f"The log above says why.")
    if server.drained is not None:
        finished, ended = server.drained
        print(f"graphinfer: stopped after {time.monotonic() - t0:.1f} s: {finished} request(s) finished while "
              f"draining, {ended} ended at the shutdown timeout; KV-cache blocks in use: {kv_blocks_in_use}",
              flush=True)


def _model_name(path: str) -> str:
    base = os.path.basename(path.rstrip("/"))
    return os.path.splitext(base)[0] if base.endswith((".gguf", ".safetensors")) else base
