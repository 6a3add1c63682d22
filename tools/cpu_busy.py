"""16 offline greedy tokens on the bundled SmolLM2 (fp32), timed (issue 55, item 5: graceful under a busy CPU).

Run under different thread settings (OMP_NUM_THREADS, OMP_WAIT_POLICY) with and without a CPU hog
(`python -c "while True: pass" &`) to compare; prints the median of --reps generates after one warm-up."""
import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from graphinfer import LLM, SamplingParams

    llm = LLM(dtype="float32")
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    prompt = "Write a short story about a robot who learns to paint."
    llm.generate(prompt, sp, use_tqdm=False)
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                      "GRAPHINFER_CPU_BUSY_THREADS") if k in os.environ}
    import torch

    env = {**env, "threads": torch.get_num_threads()}
    print(f"{env}: median {statistics.median(times):.3f} s over {a.reps} ({', '.join(f'{t:.3f}' for t in times)})")


if __name__ == "__main__":
    main()
