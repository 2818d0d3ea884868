"""One chunk of a cache build over a long L1 memory: where a long build's per-chunk time goes.

A build's chunk attends to the L1 memory of every chunk before it (P entries) and to itself (L rows);
at 128K with the shipped geometry P reaches 4,080 while L stays 528, so the chunk's attention runs with
an explicit "all memory, causal inside the chunk" mask. This times one chunk's forward at several P,
alternating two arms in one process: the mask made once per forward and shared by its layers (the
kernel as it is) and made again in every layer (as before), beside the chunk's floor at the run's matmul
rate (weights and attention FLOPs, benchmarks/floors.py).

    python benchmarks/chunk_cost.py                                   # tiny random model (CI)
    python benchmarks/chunk_cost.py --model base:qwen2.5-coder-0.5b-instruct --prefix 1008 2032 4080 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import build_floor, machine_rates  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a base folder or base:NAME (default: a tiny random Qwen2)")
    p.add_argument("--prefix", type=int, nargs="+", default=[256, 1024], help="L1 memory entries before the chunk")
    p.add_argument("--stride", type=int, default=512, help="raw tokens of the chunk")
    p.add_argument("--interval", type=int, default=32, help="one L1 token per this many raw tokens")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two arms (median of each)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def _model(name: str | None):
    import torch

    from acre_train.modeling import attach_acre

    if name:
        from transformers import AutoModelForCausalLM

        from acre_train.base.fetch import resolve_source

        model = AutoModelForCausalLM.from_pretrained(resolve_source(name), dtype=torch.float32)
    else:
        from acre_train.tiny import tiny_model

        model = tiny_model("qwen2", vocab_size=1024, eos_token_id=0, max_position_embeddings=1 << 16,
                           hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2)
    return attach_acre(model).eval()


def chunk_forward(model, plan, prefix_kv, rebuild_masks: bool) -> float:
    """Seconds of one chunk's forward over ``prefix_kv`` (per layer: rotated keys, values)."""
    import torch

    from acre_train.modeling import acre_forward
    from acre_train.modeling import visibility

    def per_layer(self, num_prefix, length, device, dtype=None):  # the mask as the kernel made it before
        mask = visibility.chunk_mask(num_prefix, length, device)
        return mask if dtype is None else visibility.to_additive(mask, dtype)

    shared = visibility.AttentionKernel._chunk_mask
    if rebuild_masks:
        visibility.AttentionKernel._chunk_mask = per_layer
    try:
        t = lambda a: torch.as_tensor(a)[None]  # noqa: E731
        tic = time.perf_counter()
        with torch.no_grad():
            acre_forward(model, input_ids=t(plan.input_ids), is_l1=t(plan.is_l1), chunk_ids=torch.zeros_like(t(plan.chunk_ids)),
                         positions=t(plan.positions), memory_positions=t(plan.memory_positions), kernel="chunked",
                         prefix=lambda layer: prefix_kv[layer])
        return time.perf_counter() - tic
    finally:
        visibility.AttentionKernel._chunk_mask = shared


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch

    from acre_train.modeling import interleave

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model(args.model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rates = machine_rates("cpu")
    print(f"model: {args.model or 'tiny random qwen2'}, fp32, {torch.get_num_threads()} threads; "
          f"matmul {rates['gflops']:.0f} GFLOP/s measured now; chunk of {args.stride} raw tokens, l {args.interval}")
    for p in args.prefix:
        ids = np.random.default_rng(p).integers(10, cfg.vocab_size - 10, args.stride)
        plan = interleave(ids, first_chunk=args.stride, stride=args.stride, intervals=args.interval)
        plan = dataclasses.replace(plan, positions=plan.positions + p,  # after P memory positions, as in a long build
                                   memory_positions=plan.memory_positions + p)
        prefix_kv = {layer: tuple(torch.randn(1, cfg.num_key_value_heads, p, head_dim) for _ in range(2))
                     for layer in range(cfg.num_hidden_layers)}
        rows = len(plan.input_ids)
        chunk_forward(model, plan, prefix_kv, False)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for rebuild in (False, True):
                times[rebuild].append(chunk_forward(model, plan, prefix_kv, rebuild))
        shared, rebuilt = statistics.median(times[False]), statistics.median(times[True])
        floor = build_floor(model, rows=rows, pairs=rows * p + rows * (rows + 1) // 2, rates=rates)
        print(f"  P {p:>5}: {rows} rows, mask once per forward {shared:.3f}s, once per layer {rebuilt:.3f}s "
              f"({rebuilt / shared:.2f}x); floor {floor:.3f}s, the chunk at {shared / floor:.2f}x it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
