"""Forward+backward cost of ACRE stage-1 training against plain full-attention training.

Same model (a small random Qwen2, or ``--model``), same raw tokens, on this machine, side by side in
one run: seconds per step (tokens/s too, in ``--json``) and peak memory (resident set of a fresh
process per measurement, so runs do not share a high-water mark). ACRE uses the official chunking (W0 = 4096, S = 2048) with intervals drawn from
{8, 16, 32, 64, 128}; the full-attention baseline trains the base q/k/v on the causal model.

    python benchmarks/attention_cost.py                 # 4K, 8K, 16K raw tokens
    python benchmarks/attention_cost.py --lengths 4096 --steps 1
    python benchmarks/attention_cost.py --model base:qwen2.5-coder-0.5b-instruct --lengths 2048,4096 \
        --first-chunk 1024 --stride 512 --intervals 8,16,32 --threads 2 --steps 1 --warmup 0 --compare-lm-head

Both arms compute the loss through the same chunked LM head (``chunked_lm_loss``), so the columns
compare attention, not heads. ``--compare-lm-head`` adds a third arm, ACRE with the one-shot head
(full logits materialised, the code before the chunked head), to show what chunking saves.
``--gradient-checkpointing`` turns it on in every arm (what a recipe does when memory needs it).

Also reported: achieved GFLOP/s of each step (``acre_train.train.cost.step_flops``), to set against
this machine's matmul peak (printed first, measured with a 2048^3 fp32 matmul).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def _model(source: str | None):
    import torch

    from acre_train.tiny import tiny_model

    if source is None:
        return tiny_model("qwen2", vocab_size=1024, **SMALL).train()
    from transformers import AutoModelForCausalLM

    from acre_train.base.fetch import resolve_source

    return AutoModelForCausalLM.from_pretrained(resolve_source(source), dtype=torch.float32).train()


def measure(method: str, length: int, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)

    import acre_train.modeling.adapter as adapter
    from acre_train.modeling import acre_forward, attach_acre, interleave, num_chunks, sample_intervals
    from acre_train.modeling.batch import pad_batch
    from acre_train.train.cost import step_flops

    torch.manual_seed(0)
    model = _model(args.model)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "acre-oneshot-head":
        adapter.LM_HEAD_ROWS = 1 << 40  # one slice: the whole [tokens, vocab] logits at once
    kernel, steps = args.kernel, args.steps
    raw = torch.randint(0, 1024, (length,))
    if method.startswith("acre"):
        attach_acre(model)
        choices = [int(v) for v in args.intervals.split(",")]
        intervals = sample_intervals(num_chunks(length, args.first_chunk, args.stride), choices, seed=(0, 0))
        batch = pad_batch([interleave(raw.tolist(), first_chunk=args.first_chunk, stride=args.stride,
                                      intervals=intervals).as_dict()])
        flops = step_flops(model, [batch])
        step = lambda: acre_forward(model, **batch, kernel=kernel).loss  # noqa: E731
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(any(k in name for k in ("q_proj", "k_proj", "v_proj")))
        ids = raw[None]
        flops = step_flops(model, [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}],
                           trains_base=False)  # only q/k/v train: their weight grads are ~2 % of the FLOPs

        def step():
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
            return adapter.chunked_lm_loss(model.lm_head, hidden, ids[0, 1:]) / (length - 1)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(args.warmup):  # first-call costs (allocator, code paths); negligible next to a real base's step
        step().backward()
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):  # best of N: on a shared machine the minimum is the least disturbed
        start = time.perf_counter()
        step().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    seconds = min(times)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens_per_s": length / seconds, "seconds": seconds, "peak_mb": peak / 1024,
            "extra_mb": (peak - base_rss) / 1024, "gflops_per_s": flops / seconds / 1e9}


def matmul_peak_gflops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate (best of ``repeats``), the ceiling a training step can approach."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _child_args(args) -> list[str]:
    out = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--kernel", args.kernel, "--threads", str(args.threads),
           "--first-chunk", str(args.first_chunk), "--stride", str(args.stride), "--intervals", args.intervals]
    out += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    return out + (["--model", args.model] if args.model else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4096,8192,16384")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--kernel", default="chunked")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measurement (1 is steadiest here)")
    parser.add_argument("--model", default=None, help="a base folder or base:NAME (default: a small random Qwen2)")
    parser.add_argument("--first-chunk", type=int, default=4096)
    parser.add_argument("--stride", type=int, default=2048)
    parser.add_argument("--intervals", default="8,16,32,64,128")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant, in every arm")
    parser.add_argument("--compare-lm-head", action="store_true",
                        help="add an ACRE arm with the one-shot LM head (full logits), the code before chunking")
    parser.add_argument("--json", default=None, help="also write every arm's figures to this file")
    parser.add_argument("--_child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(measure(args._child[0], int(args._child[1]), args)))
        return

    peak = matmul_peak_gflops(args.threads)
    print(f"model: {args.model or f'qwen2 {SMALL}'}, fp32, {args.threads} thread(s), best of {args.steps} steps after "
          f"{args.warmup} warm-up; ACRE kernel: {args.kernel}, W0={args.first_chunk} S={args.stride} l in {{{args.intervals}}}; "
          f"matmul peak here: {peak:,.0f} GFLOP/s\n")
    arms = ("full", "acre", "acre-oneshot-head") if args.compare_lm_head else ("full", "acre")
    print(f"{'raw tokens':>10} | {'full s':>7} {'ACRE s':>7} {'speed x':>7} | {'full MB':>8} {'ACRE MB':>8} "
          f"{'mem ratio':>9} | {'full GF/s':>9} {'ACRE GF/s':>9}"
          + (f" | {'1-shot head s':>13} {'MB':>7}" if args.compare_lm_head else ""))
    rows = []
    for length in (int(v) for v in args.lengths.split(",")):
        res = {method: _run_arm(args, method, length) for method in arms}
        rows.append({"raw_tokens": length, **res})
        print(_row(length, res, args.compare_lm_head), flush=True)
    print("\ns = seconds per fwd+bwd step; speed x = full s / ACRE s; MB = peak resident memory added by the "
          "training step; mem ratio = ACRE / full" + ("; 1-shot head = ACRE with full logits (before chunking)"
                                                      if args.compare_lm_head else "") + ".")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "matmul_peak_gflops": peak, "rows": rows}, indent=2))


def _run_arm(args, method: str, length: int) -> dict:
    """One arm in a fresh process (its own peak RSS); a killed child (out of memory) is reported, not raised."""
    cmd = [sys.executable, __file__, *_child_args(args), "--_child", method, str(length)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        why = "killed (out of memory?)" if proc.returncode < 0 else (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return {"error": why}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(length: int, res: dict, one_shot: bool) -> str:
    f, a = res["full"], res["acre"]

    def cell(r: dict, key: str, width: int, fmt: str = ",.1f") -> str:
        return f"{'err':>{width}}" if "error" in r else f"{r[key]:>{width}{fmt}}"

    both = "error" not in f and "error" not in a
    line = (f"{length:>10,} | {cell(f, 'seconds', 7, '.2f')} {cell(a, 'seconds', 7, '.2f')} "
            f"{(f['seconds'] / a['seconds'] if both else float('nan')):>7.2f} | {cell(f, 'extra_mb', 8, ',.0f')} "
            f"{cell(a, 'extra_mb', 8, ',.0f')} {(a['extra_mb'] / f['extra_mb'] if both else float('nan')):>9.2f} | "
            f"{cell(f, 'gflops_per_s', 9, ',.0f')} {cell(a, 'gflops_per_s', 9, ',.0f')}")
    if one_shot:
        o = res["acre-oneshot-head"]
        line += f" | {cell(o, 'seconds', 13, '.2f')} {cell(o, 'extra_mb', 7, ',.0f')}"
    errors = [f"{m}: {r['error']}" for m, r in res.items() if "error" in r]
    return line + (f"   ({'; '.join(errors)})" if errors else "")


if __name__ == "__main__":
    main()
