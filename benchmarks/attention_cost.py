"""Forward+backward cost of ACRE stage-1 training against plain full-attention training.

Same small Qwen2-architecture model, same raw tokens, on this machine, side by side in one run:
tokens/s and peak memory (resident set of a fresh process per measurement, so runs do not share a
high-water mark). ACRE uses the official chunking (W0 = 4096, S = 2048) with intervals drawn from
{8, 16, 32, 64, 128}; the full-attention baseline trains the base q/k/v on the causal model.

    python benchmarks/attention_cost.py                 # 4K, 8K, 16K raw tokens
    python benchmarks/attention_cost.py --lengths 4096 --steps 1
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def measure(method: str, length: int, steps: int, kernel: str | None, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)

    from acre_train.modeling import acre_forward, attach_acre, interleave, num_chunks, sample_intervals
    from acre_train.modeling.batch import pad_batch
    from acre_train.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen2", vocab_size=1024, **SMALL).train()
    raw = torch.randint(0, 1024, (length,))
    if method == "acre":
        attach_acre(model)
        intervals = sample_intervals(num_chunks(length, 4096, 2048), [8, 16, 32, 64, 128], seed=(0, 0))
        batch = pad_batch([interleave(raw.tolist(), first_chunk=4096, stride=2048, intervals=intervals).as_dict()])
        step = lambda: acre_forward(model, **batch, kernel=kernel).loss  # noqa: E731
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(any(k in name for k in ("q_proj", "k_proj", "v_proj")))
        ids = raw[None]
        step = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step().backward()  # warm-up
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):  # best of N: on a shared machine the minimum is the least disturbed
        start = time.perf_counter()
        step().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    seconds = min(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens_per_s": length / seconds, "seconds": seconds, "peak_mb": peak / 1024, "extra_mb": (peak - base_rss) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kernel", default="chunked")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement (1 is steadiest here)")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(measure(args._child[0], int(args._child[1]), args.steps, args.kernel, args.threads)))
        return

    print(f"model: qwen2 {SMALL}, fp32, {args.threads} thread(s), best of {args.steps} steps after a warm-up; "
          f"ACRE kernel: {args.kernel}\n")
    print(f"{'raw tokens':>10} | {'full tok/s':>10} {'ACRE tok/s':>10} {'speed x':>8} | {'full MB':>8} {'ACRE MB':>8} {'mem ratio':>9}")
    for length in (int(v) for v in args.lengths.split(",")):
        res = {}
        for method in ("full", "acre"):
            cmd = [sys.executable, __file__, "--steps", str(args.steps), "--kernel", args.kernel,
                   "--threads", str(args.threads), "--_child", method, str(length)]
            res[method] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        f, a = res["full"], res["acre"]
        print(f"{length:>10,} | {f['tokens_per_s']:>10,.0f} {a['tokens_per_s']:>10,.0f} {a['tokens_per_s'] / f['tokens_per_s']:>8.2f} | "
              f"{f['extra_mb']:>8,.0f} {a['extra_mb']:>8,.0f} {a['extra_mb'] / f['extra_mb']:>9.2f}")
    print("\nspeed x = ACRE tokens/s / full tokens/s; MB = peak resident memory added by the training step; "
          "mem ratio = ACRE / full.")


if __name__ == "__main__":
    main()
