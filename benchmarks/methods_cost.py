"""Time to first token and peak memory of every evaluation method, as ratios to ``full``.

One run, several context sizes, one small model (a tiny random Qwen2 by default, or ``--model``).
Contexts are random tokens cut into documents of ``--doc-tokens``; only cost is measured here.

    python benchmarks/methods_cost.py                      # 8K, 16K, 32K on a tiny random model
    python benchmarks/methods_cost.py --sizes 4096 --methods full,infoflow --repeats 3

TTFT = prepare (query-independent caching) + answer until the first token's logits; "online" is
the answer part alone (what a cache reused across questions costs). "answer s" is the online answer
with ``--new-tokens`` greedy tokens decoded, printed beside its floor (``benchmarks/floors.py``: the
rows and KV entries the method chose to compute and attend, at this machine's measured rates), so
"x floor" is each method's implementation overhead, not its algorithm's cost. Peak memory: CUDA allocator
peak, or sampled RSS growth on CPU (an estimate). Each cell is the median of ``--repeats`` runs
after one warm-up run per method.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from acre_train.measure import PeakMemory
from acre_train.eval.methods import GenerationConfig, parse_methods
from acre_train.eval.prompt import PreparedExample
from acre_train.eval.examples import Example

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import machine_rates, question_floor  # noqa: E402

DEFAULT_METHODS = ("full,truncated:ratio=0.25,cachefocus,cachefocus:allocation=sort,infoflow,infoflow:reorder=true,"
                   "no-recompute,cacheblend,epic")


def tiny_model(vocab: int, max_pos: int, layers: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 16, num_key_value_heads=2,
                                   max_position_embeddings=max_pos)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def example(context: int, doc_tokens: int, vocab: int, seed: int) -> PreparedExample:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    docs = [ids(min(doc_tokens, context - i)) for i in range(0, context, doc_tokens)]
    ex = Example(id=f"bench-{context}", question="q?", answers=["a"], documents=["d"] * len(docs))
    return PreparedExample(ex, ids(24), docs, ids(24), [])


def measure(model, method, prep: PreparedExample, device: torch.device, new_tokens: int, rates: dict[str, float]
            ) -> tuple[float, float, int, int, float, float]:
    """(ttft incl. prepare, online ttft, peak bytes, KV bytes attended at the first step, online answer s
    with decoding, that answer's floor s) of one run."""
    with torch.no_grad(), PeakMemory(device) as mem:
        t0 = time.perf_counter()
        state = method.prepare(model, None, prep)
        prepare_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = method.answer(model, _Detok(), prep, state, GenerationConfig(max_new_tokens=new_tokens))
        answer_s = time.perf_counter() - t0
    cost = res.cost
    if state is None:  # the answer prefills its own prompt; causal, so a row attends half of it on average
        rows, keys = cost.tokens_prefilled, cost.kv_attended / 2
    else:  # the question's rows, plus what the method runs again (CacheFocus's second pass, InfoFlow's rows)
        rows, keys = len(prep.suffix_ids) + cost.token_layers_recomputed / model.config.num_hidden_layers, cost.kv_attended
    floor = question_floor(model, rows=rows, keys=keys, new_tokens=len(res.output_ids), rates=rates)
    del state
    return prepare_s + cost.ttft_s, cost.ttft_s, mem.added_bytes, cost.kv_bytes, answer_s, floor["floor_question_s"]


class _Detok:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8192,16384,32768", help="context sizes in tokens")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--model", default=None, help="HF folder; default: tiny random Qwen2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64, help="tiny model width (head_dim 16)")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy tokens decoded per answer (no stop token)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = parse_methods(args.methods)
    if methods[0].label() != "full":
        methods.insert(0, parse_methods("full")[0])
    device = torch.device(args.device)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval().to(device)
    else:
        model = tiny_model(1024, max(sizes) + 256, args.layers, args.hidden).to(device)
    vocab = model.config.vocab_size
    print(f"model: {args.model or 'tiny random Qwen2'}  layers={model.config.num_hidden_layers} "
          f"hidden={model.config.hidden_size}  device={device}  threads={torch.get_num_threads()}", flush=True)
    rates = machine_rates(str(device))
    print(f"floors at matmul {rates['gflops']:.0f} GFLOP/s, read {rates['gemv_gbps']:.1f} GB/s by matrix-vector ({rates['gbps']:.1f} by sum; measured now); "
          f"answers decode {args.new_tokens} tokens", flush=True)
    warm = example(1024, args.doc_tokens, vocab, 0)
    for m in methods:  # warm-up: first calls pay for lazy init / allocator growth
        measure(model, m, warm, device, args.new_tokens, rates)
    header = (f"{'context':>8} {'method':<28} {'TTFT s':>8} {'TTFT/full':>9} {'online/full':>11} {'peak MiB':>9} "
              f"{'mem/full':>8} {'KV/full':>7} {'answer s':>9} {'floor s':>8} {'x floor':>7}")
    print(header)
    print("-" * len(header))
    for size in sizes:
        prep = example(size, args.doc_tokens, vocab, size)
        base: tuple[float, float, float, float] | None = None
        for m in methods:
            runs = [measure(model, m, prep, device, args.new_tokens, rates) for _ in range(args.repeats)]
            ttft, online, peak, kv, answer, floor = (statistics.median(x) for x in zip(*runs))
            if base is None:
                base = (ttft, online, max(peak, 1), kv)
            print(f"{size:>8} {m.label():<28} {ttft:>8.3f} {ttft / base[0]:>9.2f} {online / base[1]:>11.2f} "
                  f"{peak / 2**20:>9.1f} {peak / base[2]:>8.2f} {kv / base[3]:>7.2f} {answer:>9.3g} {floor:>8.3g} "
                  f"{answer / floor:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
