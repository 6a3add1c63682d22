"""`graphinfer bench startup ART`: how long `graphinfer serve ART` takes until /health answers, in fresh processes.

Each run starts `python -m graphinfer.cli serve ART` on a free loopback port, polls /health, and reads the
start-up phases the server logs (`start-up: weights 0.41 s`, ...). Cache states:

  cold      every cache outside the artifact empty (Triton's, TorchInductor's, graphinfer's hash memo) and the
            artifact's kernel cache ignored (GRAPHINFER_KERNEL_CACHE=off): everything compiled and hashed anew
  artifact  a fresh machine with the artifact: caches outside it empty, its kernel cache used
  warm      a restart on the same machine: every cache as it is, the artifact's kernel cache used

On cpu an artifact has no kernel cache (the reference ops compile nothing): the states differ only in the hash
memo and the OS file cache.
"""
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from graphinfer.bench.common import environment, markdown_table, write_json
from graphinfer.errors import GraphinferError

_PHASE = re.compile(r"start-up: (.+?) (\d+\.\d+) s$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


CACHE_STATES = ("cold", "artifact", "warm")


def start_once(art: str, cache: str, extra_args: list[str], timeout: float) -> dict:
    """One fresh `serve` process: seconds until /health answered, and the phases it logged."""
    port = _free_port()
    env = dict(os.environ, GRAPHINFER_LOG_LEVEL="INFO")
    scratch = None
    if cache != "warm":
        scratch = tempfile.mkdtemp(prefix=f"graphinfer-{cache}-")
        env.update(TRITON_CACHE_DIR=os.path.join(scratch, "triton"), GRAPHINFER_CACHE_DIR=os.path.join(scratch, "gi"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"))
    if cache == "cold":
        env["GRAPHINFER_KERNEL_CACHE"] = "off"
    log = tempfile.TemporaryFile("w+")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "graphinfer.cli", "serve", art, "--host", "127.0.0.1",
                             "--port", str(port), *extra_args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)
    try:
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None or time.perf_counter() - start > timeout:
                log.seek(0)
                raise GraphinferError(f"`graphinfer serve {art}` did not become healthy "
                                      f"({'exited ' + str(proc.returncode) if proc.poll() is not None else 'timed out'}):"
                                      f"\n{log.read()[-3000:]}")
            time.sleep(0.05)
        healthy = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    log.seek(0)
    phases: dict[str, float] = {}
    for line in log.read().splitlines():
        if m := _PHASE.search(line):
            phases[m[1]] = phases.get(m[1], 0.0) + float(m[2])
    if scratch is not None:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return {"cache": cache, "healthy_s": round(healthy, 3),
            "phases_s": {k: round(v, 3) for k, v in phases.items()}}


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(art: str, runs: int = 3, caches: list[str] = CACHE_STATES, extra_args: list[str] | None = None,
        timeout: float = 600.0, output_json: str | None = None) -> dict:
    from graphinfer.compiler.artifact import read_manifest

    manifest = read_manifest(art)
    if bad := [c for c in caches if c not in CACHE_STATES]:
        raise GraphinferError(f"caches {bad}: use any of {', '.join(CACHE_STATES)}.")
    rows, table = [], []
    for cache in caches:
        for i in range(runs):
            r = start_once(art, cache, extra_args or [], timeout)
            rows.append(r)
            print(f"{cache} run {i + 1}/{runs}: healthy in {r['healthy_s']:.2f} s  "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items()), flush=True)
        times = [r["healthy_s"] for r in rows if r["cache"] == cache]
        table.append([cache, runs, f"{min(times):.2f}", f"{statistics.median(times):.2f}", f"{max(times):.2f}"])
    result = {"bench": "startup", "artifact": os.path.abspath(art), "model": manifest["model"]["path"],
              "platform": manifest["platform"], "graph_mode": manifest["graph_mode"], "dtype": manifest["dtype"],
              "extra_args": extra_args or [], "load_average_at_end": _load_average(),
              "environment": environment(manifest["platform"] if manifest["platform"] != "cpu" else "cpu"),
              "runs": rows}
    print("\n" + markdown_table(["kernel caches", "runs", "healthy min s", "median s", "max s"], table))
    write_json(output_json, result)
    return result
