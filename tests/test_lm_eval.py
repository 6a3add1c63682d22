"""lm-eval (EleutherAI's harness, pinned in the Makefile) as a client of graphinfer: `local-completions` against
`graphinfer serve` and lm-eval's Python API over graphinfer.LLM (graphinfer/bench/lm_eval_harness.py) choose the same
answer as lm-eval's own hf backend on every item of a shipped multiple-choice task (SmolLM2, fp32), and
`local-chat-completions` runs a shipped generation task to the end."""
import os
import types

import httpx
import pytest
import torch

pytest.importorskip("lm_eval")
import lm_eval.tasks  # noqa: E402

from graphinfer.bench.lm_eval_harness import _free_port, _Server, disagreements, evaluate  # noqa: E402

TASK, LIMIT = "graphinfer_capitals", 16  # 16 questions x 4 choices: 64 loglikelihood requests per backend


class _GraphinferTasksOnly(lm_eval.tasks.TaskManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "include_defaults": False})


@pytest.fixture(scope="module", autouse=True)
def graphinfer_tasks_only():
    """evaluate()'s TaskManager indexes graphinfer's tasks and every task lm-eval ships (a walk over thousands of
    YAML files, seconds each of the three runs here); these tests run graphinfer's own tasks only, so lm-eval's are
    left out of the index."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval.tasks, "TaskManager", _GraphinferTasksOnly)
        yield


@pytest.fixture(scope="module")
def server(openai_server):
    """The session's SmolLM2 `graphinfer serve` (conftest: fp32, async scheduling; the OpenAI-surface tests' server,
    started on each worker anyway) for the completions and the chat runs, as the started server evaluate() takes:
    its URL and the model name it serves. _Server, which evaluate() starts without one: the last test."""
    name = httpx.get(f"{openai_server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    return types.SimpleNamespace(url=openai_server.url, model_name=name)


@pytest.fixture(scope="module")
def hf_run(smollm2_path, hf_smollm2):
    """lm-eval's hf backend on SmolLM2, the reference. Its loader (lm_eval_harness._hf_lm) runs, but the transformers
    load it asks for, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=float32), is answered with
    the session's hf_smollm2 (conftest: that very call; loaded once per worker for the real-weights tests) instead
    of a second ~10 s GGUF conversion."""
    import transformers

    model, _ = hf_smollm2
    folder, name = os.path.split(smollm2_path)
    real, asked = transformers.AutoModelForCausalLM.from_pretrained, []

    def from_pretrained(path, *args, **kwargs):
        if (path, kwargs.get("gguf_file"), kwargs.get("dtype")) == (folder, name, torch.float32) and not args:
            asked.append(path)
            return model
        return real(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
        run = evaluate("hf", smollm2_path, [TASK], limit=LIMIT)
    assert asked == [folder]  # the session's model answered _hf_lm's load
    return run


@pytest.mark.parametrize("backend", ["server", pytest.param("llm", marks=pytest.mark.slow)])  # llm: ~18 s, same answers path
def test_multiple_choice_answers_equal_the_hf_backend(smollm2_path, hf_run, backend, request, tmp_path):
    served = request.getfixturevalue("server") if backend == "server" else None
    run = evaluate(backend, smollm2_path, [TASK], limit=LIMIT, work_dir=str(tmp_path), server=served)
    assert len(run["answers"][TASK]) == LIMIT
    assert disagreements(run, hf_run) == {TASK: 0}, (run["answers"], hf_run["answers"])
    assert run["metrics"][TASK]["acc,none"] == hf_run["metrics"][TASK]["acc,none"] > 0.5  # SmolLM2 knows capitals


def test_chat_completions_run_a_generation_task(smollm2_path, server, tmp_path):
    run = evaluate("chat", smollm2_path, ["graphinfer_arith_gen"], limit=4, work_dir=str(tmp_path), server=server)
    assert len(run["answers"]["graphinfer_arith_gen"]) == 4
    assert "exact_match,first_number" in run["metrics"]["graphinfer_arith_gen"]


_STUB_SERVE = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "stub-model"}]}).encode() if self.path == "/v1/models" else b"{}"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_helper_starts_serve_and_closes_it(tmp_path, monkeypatch):
    """_Server (what evaluate() starts for a server or chat run given none; `bench accuracy --lm-eval`): the
    `graphinfer serve MODEL --host --port ARGS` command line in a child process, ready once /v1/models answers, the
    model name read from it, the process ended by close(). The child is a stub answering /v1/models (a real
    `graphinfer serve` of SmolLM2 answers the tests above; the stub spares a second server start)."""
    import subprocess
    import sys

    from graphinfer.bench import lm_eval_harness

    launched, real_popen = [], subprocess.Popen

    def popen(cmd, **kwargs):  # subprocess is the process-wide module: only the serve command is replaced
        if "graphinfer.cli" not in cmd:
            return real_popen(cmd, **kwargs)
        launched.append(cmd)
        return real_popen([sys.executable, "-c", _STUB_SERVE, cmd[cmd.index("--port") + 1]], **kwargs)

    monkeypatch.setattr(lm_eval_harness.subprocess, "Popen", popen)
    port = _free_port()
    s = _Server("MODEL", ["--dtype", "float32"], port, str(tmp_path / "serve.log"))
    try:
        assert launched == [[sys.executable, "-m", "graphinfer.cli", "serve", "MODEL", "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", "float32"]]
        assert s.url == f"http://127.0.0.1:{port}" and s.model_name == "stub-model"
    finally:
        s.close()
    assert s.proc.poll() is not None and s.log.closed
