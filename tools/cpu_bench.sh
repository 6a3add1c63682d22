#!/usr/bin/env bash
# CPU benchmarks of issue 20 (docs/benchmarks.md, "The CPU platform"): bundled SmolLM2-135M.
#
#   tools/cpu_bench.sh [STEP ...]     STEP: throughput | throughput_bf16 | latency | inductor | reference | quant | gemv | peers
#                                     (default: the first three)
#
#   throughput       64 prompts of 64-256 random tokens, 64 greedy new tokens each, ignore_eos, prefix caching off,
#                    dtype auto (fp32 without native bf16), default kernels (eager), and HF transformers fp32 in the same run
#   throughput_bf16  the same in bf16 (HF still fp32: its fair CPU figure)
#   latency          batch 1: TTFT and decode tok/s (128-token prompt, 64 new), and the prefill of a 4,096-token
#                    prompt, fp32 and bf16 (tools/cpu_latency.py)
#   inductor         the throughput workload on the Inductor lowering (kernels=inductor)
#   reference        the throughput workload on the reference ops (kernels=reference)
#   quant            issue 27: the GGUF kept quantized (gguf) and int8_wo vs fp32, batch 1 and the 64-prompt workload,
#                    with llama.cpp (the same GGUF) in the same run: tools/cpu_peers.sh with
#                    ENGINES=graphinfer-fp32,graphinfer-int8_wo,graphinfer-gguf,llama.cpp (INSTALL=1 builds .venv-peers)
#   attention        issue 30: the CPU paged attention alone (decode at batch 64, prefills of 162-4,096 tokens), graphinfer's
#                    kernel vs its ATen flash path, and vLLM-CPU's kernel where .venv-vllm exists
#                    (tools/cpu_attention_bench.py)
#   gemv             issue 30: batch-1 decode's linears alone, graphinfer's few-row kernel vs oneDNN prepacked, MKL and
#                    a plain read of the weights (tools/cpu_gemv_bench.py)
#   peers            issue 30: graphinfer fp32 / bf16 vs vLLM-CPU fp32 / bf16, llama.cpp and HF fp32 in one run:
#                    tools/cpu_peers.sh (= tools/cpu_peers.py --output-json $OUT/cpu_peers.json; INSTALL=1 first
#                    installs .venv-vllm and .venv-peers)
#
# Results (JSON and logs) go to $OUT, else ./bench-out. Other processes on the machine lower the numbers: the
# JSON records the load average at the start. SMOKE=1: a short rehearsal (4 prompts, 8 new tokens, 256-token prefill).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-$PWD}"
OUT_DIR="${OUT:-./bench-out}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT_DIR"
MODEL="${MODEL:-$("$PY" -c 'from graphinfer.config import bundled_model_path; print(bundled_model_path())')}"
N=64 NEW=64 PREFILL=4096
if [ "${SMOKE:-0}" = 1 ]; then N=4 NEW=8 PREFILL=256; fi
WORKLOAD=(--model "$MODEL" --device cpu --num-prompts "$N" --min-len 64 --max-len 256 --fixed-output-len "$NEW"
          --temperature 0 --no-prefix-caching --max-num-seqs 256)
throughput() {
  "$PY" -m graphinfer.cli bench throughput "${WORKLOAD[@]}" --dtype "$1" --compare hf --hf-dtype float32 ${2:+--kernels "$2"} \
    --output-json "$OUT_DIR/throughput_$1${2:+_$2}.json" 2>&1 | tee "$OUT_DIR/throughput_$1${2:+_$2}.log"
}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(throughput throughput_bf16 latency)
for step in "${steps[@]}"; do
  echo "== $step (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  case "$step" in
    throughput) throughput auto ;;
    throughput_bf16) throughput bfloat16 ;;
    inductor) throughput auto inductor ;;
    reference) throughput auto reference ;;
    quant)
      MODEL="$MODEL" NAME=quant_peers PREFILL=0 ENGINES=graphinfer-fp32,graphinfer-int8_wo,graphinfer-gguf,llama.cpp \
        tools/cpu_peers.sh ;;
    peers) MODEL="$MODEL" tools/cpu_peers.sh ;;
    gemv) "$PY" tools/cpu_gemv_bench.py --rows 1,2,4 --output-json "$OUT_DIR/cpu_gemv.json" ;;
    attention)
      "$PY" tools/cpu_attention_bench.py --output-json "$OUT_DIR/cpu_attention_graphinfer.json"
      if [ -x .venv-vllm/bin/python ]; then
        .venv-vllm/bin/python tools/cpu_attention_bench.py --engine vllm --output-json "$OUT_DIR/cpu_attention_vllm.json"
      fi ;;
    latency)
      for dt in float32 bfloat16; do
        "$PY" tools/cpu_latency.py --model "$MODEL" --dtype "$dt" --max-tokens "$NEW" --prefill-len "$PREFILL" | tee -a "$OUT_DIR/latency.jsonl"
      done ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
