"""LoRA adapters served as vLLM serves them (issue 52), against real `graphinfer serve` processes with the official
openai client: `--enable-lora --lora-modules a=... b=...` lists both in /v1/models with their parent, a request whose
`model` names an adapter gets that adapter's greedy tokens (HF's, with the adapter merged by peft), the base model's
name the base model's, an unknown name vLLM's 404; with GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING=1 an adapter is loaded,
used and unloaded at run time (vLLM's bodies and status codes); without it those endpoints do not exist.

One LoRA server (the variable set) serves every request test; beside it starts a server whose adapter the engine
refuses (it must exit with the engine's message). The app without the variable is built in this process (its routes
alone are checked), and the CLI's own refusals (--lora-modules without --enable-lora, a malformed entry) come before
any model loads, so they run in this process too.
"""
from types import SimpleNamespace

import httpx
import openai
import pytest
from hf_zoo import greedy_of
from lora_utils import make_peft_adapter
from server_utils import Server, assert_openai_error, metric, metric_samples

from graphinfer import cli
from graphinfer.server.api_server import build_app

BASE = "tiny"
PROMPTS = [list(range(5, 5 + n)) for n in (9, 14)]
NEW = 6
ADAPTERS = {  # name -> (peft LoraConfig kwargs, seed): c is loaded at run time
    "a": (dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]), 1),
    "b": (dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]), 2),
    "c": (dict(r=8, lora_alpha=8, target_modules=["o_proj", "gate_proj", "down_proj"]), 3),
}
ENGINE = ["--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-gpu-blocks-override", "96",
          "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "64"]
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]


@pytest.fixture(scope="module")
def case(tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, {adapter: its PEFT dir}, {adapter or None: HF's greedy tokens of PROMPTS with it merged})."""
    path, hf = tiny_checkpoint("llama")
    paths, expected = {}, {None: greedy_of(hf, PROMPTS, NEW)}
    for name, (kwargs, seed) in ADAPTERS.items():
        paths[name] = str(tmp_path_factory.mktemp(f"lora-server-{name}"))
        expected[name] = greedy_of(make_peft_adapter(hf, paths[name], seed, **kwargs), PROMPTS, NEW)
    assert len({str(v) for v in expected.values()}) == len(expected)  # every adapter changes the tokens
    return path, paths, expected


@pytest.fixture(scope="module")
def servers(case, tmp_path_factory):
    """(the LoRA server, ready; the server whose adapter is refused, launched), started together."""
    path, paths, _ = case
    logs = tmp_path_factory.mktemp("lora-server")
    with pytest.MonkeyPatch.context() as mp:  # the variable reaches the LoRA server's process only
        mp.setenv("GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING", "1")
        lora = Server([path, *ENGINE, *LORA, "--served-model-name", BASE, "--lora-modules", f"a={paths['a']}",
                       f'{{"name": "b", "path": "{paths["b"]}", "base_model_name": "{BASE}"}}'],
                      logs / "lora.log").launch()
    refused = Server([path, *ENGINE, "--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"b={paths['b']}",
                      f"a={paths['a']}"], logs / "refused.log").launch()  # a's rank 8 > 4
    try:
        yield lora.wait_ready(180), refused
    finally:
        lora.stop()
        refused.stop()


@pytest.fixture(scope="module")
def client(servers):
    with openai.OpenAI(base_url=f"{servers[0].url}/v1", api_key="EMPTY", timeout=60, max_retries=0) as c:
        yield c


def _tokens(client, model: str, prompt: list[int]) -> list[int]:
    """The greedy completion's token ids (logprobs' tokens as "token_id:<id>", vLLM's return_tokens_as_token_ids)."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert out.model == model
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_models_lists_the_adapters_with_their_parent(client, case):
    _, paths, _ = case
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "a", "b"]
    assert cards[BASE].parent is None and cards[BASE].model_extra["max_model_len"] == 64
    for name in ("a", "b"):
        assert cards[name].parent == BASE and cards[name].root == paths[name]
        assert cards[name].object == "model"
        assert cards[name].model_extra["permission"][0]["object"] == "model_permission"


def test_model_names_the_adapter(client, case, servers):
    """Each adapter's greedy tokens, the base model's by its name; concurrent requests of both adapters and the base
    model share the batch."""
    _, _, expected = case
    assert _tokens(client, "b", PROMPTS[0]) == expected["b"][0]
    assert _tokens(client, BASE, PROMPTS[1]) == expected[None][1]
    from concurrent.futures import ThreadPoolExecutor

    jobs = [("a", 1), ("b", 1), (BASE, 0), ("a", 0)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _tokens(client, job[0], PROMPTS[job[1]]), jobs))
    assert got == [expected[None if m == BASE else m][i] for m, i in jobs]
    # vLLM's lora_requests_info gauge (nothing running now: the adapters' labels are empty)
    info = metric_samples(httpx.get(f"{servers[0].url}/metrics").text)
    assert metric(info, "graphinfer:lora_requests_info", max_lora="2", running_lora_adapters="",
                  waiting_lora_adapters="") > 0


def test_unknown_model_is_vllms_404(client, servers):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=2)
    err = assert_openai_error(httpx.post(f"{servers[0].url}/v1/completions",
                                         json={"model": "nope", "prompt": PROMPTS[0], "max_tokens": 2}), 404)
    assert err == {"message": "The model `nope` does not exist.", "type": "NotFoundError", "param": None, "code": 404}
    assert e.value.status_code == 404


def test_load_use_unload_at_runtime(client, servers, case):
    _, paths, expected = case
    url = servers[0].url
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' added successfully.")
        assert [m.id for m in client.models.list().data] == [BASE, "a", "b", "c"]
        assert _tokens(client, "c", PROMPTS[1]) == expected["c"][1]
        # vLLM's refusals: a name already loaded, a bad path (the engine's message), a missing field
        err = assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["a"]}),
                                  400)
        assert err["message"] == "The lora adapter 'c' has already been loaded." and err["type"] == "InvalidUserInput"
        err = assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/no/such"}),
                                  400)
        assert "/no/such" in err["message"] and "does not exist" in err["message"]
        assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "d"}), 400)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
        err = assert_openai_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}), 404)
        assert err["message"] == "The lora adapter 'c' cannot be found." and err["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError, match="The model `c` does not exist."):
        _tokens(client, "c", PROMPTS[1])
    assert [m.id for m in client.models.list().data] == [BASE, "a", "b"]
    assert _tokens(client, "a", PROMPTS[0]) == expected["a"][0]  # the others serve on


def test_runtime_endpoints_need_the_variable(monkeypatch):
    """Without GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist (404, OpenAI's error body); /v1/models
    lists the base model alone. (The app is built on a stand-in engine: only its routes are asked.)"""
    from fastapi.testclient import TestClient

    monkeypatch.delenv("GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    engine = SimpleNamespace(tokenizer=None, max_model_len=64, info=SimpleNamespace(num_moe_layers=0, spec_decode=None))
    http = TestClient(build_app(engine, BASE))
    for route, body in (("load_lora_adapter", {"lora_name": "x", "lora_path": "/p"}),
                        ("unload_lora_adapter", {"lora_name": "x"})):
        assert_openai_error(http.post(f"/v1/{route}", json=body), 404)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [BASE]


def test_an_adapter_refused_at_startup_stops_the_server(servers):
    """The engine refuses adapter a (rank 8 above --max-lora-rank 4): the start-up ends, non-zero, with its message."""
    refused = servers[1]
    assert refused.proc.wait(180) != 0
    log = refused.log()
    assert "graphinfer: error: --lora-modules:" in log and "max_lora_rank" in log, log[-3000:]
    assert "Traceback" not in log


def test_cli_refusals_before_the_model_loads(case, capsys):
    """--lora-modules without --enable-lora: vLLM's message, before any model loads; a malformed entry: a usage
    error naming it."""
    path, paths, _ = case
    assert cli.main(["serve", path, "--device", "cpu", "--port", "0", "--lora-modules", f"a={paths['a']}"]) == 2
    err = capsys.readouterr().err
    assert "--lora-modules (a) needs --enable-lora: LoRA is not enabled. Use --enable-lora to enable LoRA." in err
    for bad, why in (('{"name": "a"}', "Invalid fields for --lora-modules"), ("a", "give NAME=PATH"),
                     ('{"name": "a", "path": ', "Invalid JSON format for --lora-modules")):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", path, "--lora-modules", bad])
        assert e.value.code == 2 and why in capsys.readouterr().err
