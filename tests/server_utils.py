"""Shared helpers for the server tests: `graphinfer serve` as a real process on a free loopback port."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

GRAPHINFER = os.path.join(os.path.dirname(sys.executable), "graphinfer")  # the venv's console script


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`graphinfer serve ARGS` on 127.0.0.1. launch() returns at once; wait_ready() blocks until /health is 200."""

    def __init__(self, args: list[str], log_path, env: dict | None = None):
        """env: variables set for the server process on top of this one's."""
        self.args, self.log_path = args, str(log_path)
        self.env = None if env is None else {**os.environ, **env}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def launch(self) -> "Server":
        self._log = open(self.log_path, "w+")
        self.proc = subprocess.Popen([GRAPHINFER, "serve", *self.args, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env)
        return self

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphinfer serve {self.args} exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"graphinfer serve {self.args} not healthy after {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.25)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it hangs; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode


@contextlib.contextmanager
def running_servers(specs: dict[str, list[str]], log_dir):
    """Launch every server at once (their start-ups overlap), yield {name: Server}, stop them all."""
    launched = {name: Server(args, log_dir / f"{name}.log") for name, args in specs.items()}
    try:
        for s in launched.values():
            s.launch()
        yield launched
    finally:
        for s in launched.values():
            s.stop()


def processes_running(root_pid: int, module: str) -> list:
    """The live descendants of root_pid started as `python -m module`. A short-lived helper the server spawned (a
    library's subprocess) can be a zombie or gone by the time it is read: such processes are skipped."""
    import psutil

    found = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if module in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return found


def start_server(args: list[str], log_path, timeout: float = 120.0) -> Server:
    return Server(args, log_path).launch().wait_ready(timeout)


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    """The response has `status` and OpenAI's error body {"error": {"message", "type", "code"}}."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == status, err
    return err


def sse_events(lines) -> tuple[list[dict], bool]:
    """Parse server-sent event lines: (the JSON payloads, whether `data: [DONE]` ended the stream)."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        assert not done, "an event after [DONE]"
        events.append(json.loads(data))
    return events, done


def metric_samples(text: str) -> dict:
    """Prometheus text -> {(sample name, frozenset(labels without model_name)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def served_artifact_completion(checkpoint: str, compile_args: list[str], prompt: list[int], max_tokens: int, tmp_path):
    """`graphinfer compile CHECKPOINT *compile_args -o ART`, then `graphinfer serve ART`, and one greedy completion
    of `prompt` (token ids, EOS ignored) through the official openai client: (text, completion tokens)."""
    import subprocess

    from openai import OpenAI

    art = str(tmp_path / "art")
    res = subprocess.run([GRAPHINFER, "compile", checkpoint, *compile_args, "-o", art], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    server = Server([art, "--max-model-len", "256"], tmp_path / "serve.log").launch()
    try:
        server.wait_ready(180)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=os.path.basename(checkpoint), prompt=prompt, max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.choices[0].text, out.usage.completion_tokens
    finally:
        server.stop()
