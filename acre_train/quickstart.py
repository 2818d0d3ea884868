"""``acre-train quickstart``: ACRE end to end on a tiny built-in model and text, in seconds.

It builds a tiny Qwen2-architecture model (random weights, fp32), tokenizes a long built-in text
(the Python Language Reference that ships with CPython), interleaves L1 tokens, runs one ACRE
forward/backward/optimizer step and prints what it did and what it cost.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=8192, help="raw tokens of built-in text to use (default 8192)")
    parser.add_argument("--first-chunk", type=int, default=2048, help="W0: raw tokens in chunk 0 (default 2048)")
    parser.add_argument("--stride", type=int, default=1024, help="S: raw tokens in each later chunk (default 1024)")
    parser.add_argument("--intervals", default="8,16,32,64,128", help="L1 interval choices, one drawn per chunk")
    parser.add_argument("--kernel", default=None, choices=["chunked", "dense", "flex"], help="attention kernel (default: chunked on CPU)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from .data.builtin import builtin_text
    from .data.tiny_tokenizer import tiny_tokenizer
    from .modeling import acre_forward, attach_acre, count_parameters, interleave, num_chunks, sample_intervals
    from .modeling.batch import pad_batch
    from .tiny import tiny_model

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tokenizer = tiny_tokenizer()
    text = "\n\n".join(record["text"] for record in builtin_text())
    raw = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    t_tok = time.perf_counter() - t0

    choices = [int(c) for c in args.intervals.split(",")]
    n_chunks = num_chunks(len(raw), args.first_chunk, args.stride)
    intervals = sample_intervals(n_chunks, choices, seed=(args.seed, 0))
    plan = interleave(raw, first_chunk=args.first_chunk, stride=args.stride, intervals=intervals,
                      l1_token_id=tokenizer.eos_token_id)

    model = attach_acre(tiny_model("qwen2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, seed=args.seed))
    model.train()
    counts = count_parameters(model)
    batch = pad_batch([plan.as_dict()], pad_token_id=tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    t1 = time.perf_counter()
    out = acre_forward(model, **batch, kernel=args.kernel)
    t_fwd = time.perf_counter() - t1
    out.loss.backward()
    optimizer.step()
    t_step = time.perf_counter() - t1

    _print_report(plan, intervals, counts, out, t_tok, t_fwd, t_step, args)
    return 0


def _print_report(plan, intervals, counts, out, t_tok, t_fwd, t_step, args) -> None:
    print("acre-train quickstart: one ACRE training step on a tiny Qwen2 model (random weights, fp32)\n")
    print(f"text              {plan.input_ids.size - plan.num_l1:,} raw tokens of the Python Language Reference")
    print(f"interleave plan   W0={args.first_chunk}  S={args.stride}  {plan.num_chunks} chunks  "
          f"{plan.num_l1:,} L1 tokens  -> {len(plan):,} tokens, highest RoPE position {plan.max_position:,}")
    print(f"intervals         {', '.join(f'chunk {t}: {v}' for t, v in enumerate(intervals))}")
    print("parameters        " + "  ".join(f"{k}={v:,}" for k, v in counts.items()))
    print(f"loss              {out.loss.item():.4f} over {out.num_tokens:,} labelled raw tokens")
    print(f"time              tokenize {t_tok:.2f}s  forward {t_fwd:.2f}s  forward+backward+step {t_step:.2f}s "
          f"({out.num_tokens / t_step:,.0f} tokens/s)")
