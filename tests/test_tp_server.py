"""Tensor parallel behind the OpenAI server: two "nodes" on loopback (`--nnodes 2 --node-rank 0/1`) serve the
official `openai` client the tokens tp 1 gives; a rank that dies ends the server (503, a non-zero exit and a
log line naming the rank), never a hang, on one node and across nodes."""
import signal
import subprocess
import time

import httpx
import psutil
import pytest
import torch
from server_utils import GRAPHINFER, Server, free_port, processes_running

from graphinfer import LLM, SamplingParams

ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_path):
    """A tiny random Llama with SmolLM2's tokenizer and chat template (so text prompts and chat work)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphinfer.models.gguf_loader import load_gguf_tokenizer
    path = tmp_path_factory.mktemp("tiny-chat")
    tok = load_gguf_tokenizer(smollm2_path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {timeout} s after a rank died")


def test_two_nodes_on_loopback_serve_the_openai_client(tiny_chat_model, tmp_path):
    from openai import OpenAI

    port = free_port()
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    with open(tmp_path / "node1.log", "w") as log1:
        # node 1 names no model: it takes node 0's engine settings from the rendezvous
        node1 = subprocess.Popen([GRAPHINFER, "serve", *nodes, "--node-rank", "1"], stdout=log1, stderr=subprocess.STDOUT)
        node0 = Server([tiny_chat_model, *ENGINE, *nodes, "--node-rank", "0"], tmp_path / "node0.log").launch()
        try:
            node0.wait_ready(180)
            client = OpenAI(base_url=f"{node0.url}/v1", api_key="none")
            name = client.models.list().data[0].id
            done = client.completions.create(model=name, prompt="The capital of France is", max_tokens=12, temperature=0)
            chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi!"}],
                                                  max_tokens=12, temperature=0)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=name, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True))
            ref = LLM(tiny_chat_model, device="cpu", dtype="float32", max_model_len=256)
            greedy = SamplingParams(temperature=0, max_tokens=12)
            assert done.choices[0].text == streamed == ref.generate("The capital of France is", greedy,
                                                                    use_tqdm=False)[0].outputs[0].text
            assert chat.choices[0].message.content == ref.chat([{"role": "user", "content": "Hi!"}], greedy,
                                                               use_tqdm=False)[0].outputs[0].text
            # node 1 dies: node 0 learns it from its heartbeat (nothing in flight) and exits non-zero
            node1.send_signal(signal.SIGKILL)
            started = time.monotonic()
            assert _wait_exit(node0.proc, 30) != 0
            assert time.monotonic() - started < 20
            assert "tensor-parallel rank 1 (on another node) sent no heartbeat" in node0.log()
        finally:
            node0.stop()
            if node1.poll() is None:
                node1.kill()
            node1.wait(10)


def test_a_killed_worker_ends_the_server(tmp_path):
    server = Server(["tiny-llama", *ENGINE, "-tp", "2"], tmp_path / "serve.log").launch().wait_ready(120)
    try:
        # the server's engine core runs in a process of its own, which starts the tensor-parallel rank
        [worker] = processes_running(server.proc.pid, "graphinfer.runtime.executor.worker_proc")
        with httpx.Client(base_url=server.url, timeout=30) as http:
            stream = http.stream("POST", "/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2, 3],
                                                                   "max_tokens": 200, "stream": True, "ignore_eos": True})
            lines = stream.__enter__().iter_lines()
            next(lines)  # a request is being served
            worker.kill()
            started = time.monotonic()
            body = "\n".join(lines)
            stream.__exit__(None, None, None)
        assert '"code": 503' in body and "data: [DONE]" in body  # the stream in flight ends with an error event
        assert _wait_exit(server.proc, 30) != 0 and time.monotonic() - started < 15
        log = server.log()
        assert f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9" in log
        assert "the server answered 503 and exited" in log
    finally:
        server.stop()
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
