"""`graphinfer bench serve` against a real `graphinfer serve tiny-llama` process on a loopback port."""
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from graphinfer.bench.serve import run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "server.log", "w+")
    exe = os.path.join(os.path.dirname(sys.executable), "graphinfer")  # the venv's console script
    proc = subprocess.Popen([exe, "serve", "tiny-llama", "--host", "127.0.0.1", "--port", str(port),
                             "--max-num-seqs", "8", "--max-model-len", "256"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"graphinfer serve exited with {proc.returncode}:\n{log.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"graphinfer serve not healthy after 60 s:\n{log.read()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_bench_serve_levels_json_and_plot(server, tmp_path, capsys):
    import matplotlib.image

    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    result = run(server + "/v1/", [1, 4], num_prompts=8, prompt_len=16, max_tokens=8, model=None,
                 output_json=str(out_json), plot=str(out_png), timeout=60)

    saved = json.loads(out_json.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["benchmark"] == "serve" and saved["model"] == "tiny-llama" and saved["url"] == server
    assert (saved["num_prompts"], saved["prompt_len"], saved["max_tokens"]) == (8, 16, 8) and saved["date"]
    assert [lv["concurrency"] for lv in saved["levels"]] == [1, 4]
    for lv in saved["levels"]:
        assert lv["requests"] == 8 and lv["errors"] == 0, lv["first_error"]
        assert lv["output_lens"] == [8] * 8 and lv["completion_tokens"] == 64
        assert lv["output_throughput_tok_s"] > 0 and lv["request_throughput_req_s"] > 0 and lv["duration_s"] > 0
        for m in ("ttft", "tpot"):
            assert 0 < lv[f"{m}_p50_ms"] <= lv[f"{m}_p90_ms"] <= lv[f"{m}_p99_ms"]
            assert lv[f"{m}_mean_ms"] > 0
        assert 0 < lv["e2e_p50_ms"] <= lv["e2e_p99_ms"]
        assert lv["ttft_p50_ms"] <= lv["e2e_p50_ms"]

    table = capsys.readouterr().out
    assert "| C |" in table and table.count("\n| 1 |") + table.count("\n| 4 |") == 2

    assert out_png.stat().st_size > 5 * 1024
    img = matplotlib.image.imread(str(out_png))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
