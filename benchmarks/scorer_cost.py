"""What each refill scorer and each selection option costs per question, beside the memory it holds.

The scorers read what the cache holds (modeling/ranking.py): ``l1`` the L1 keys on the device, ``l2``
one layer's raw keys per scoring layer (gathered from CPU memory on a GPU node, read in place here),
``bounds`` the per-span key boxes built with the cache. This times ``rank_spans`` alone, with random
queries and keys in the head shapes of real models (the question's scoring pass, which every scorer
shares, is not included), at interval 32 (the study's) or ``--interval``::

    python benchmarks/scorer_cost.py                         # Qwen2.5-0.5B shape, 8K..64K, one layer
    python benchmarks/scorer_cost.py --shape qwen2.5-7b --layers 2 --threads 2

Columns: milliseconds per question (median of ``--repeat``), and what each scorer keeps besides the
L2 cache (MiB; ``bounds`` its key boxes; ``l2`` the scoring layers' raw keys rotated at their text
positions, made at the first question: ``read MiB`` is what it reads per question).

The second table times every selection option as a question runs it (``choose_refill``: ranking,
the sink rules, growth and its shapes), on the same random cache with a sentence end every ~24 tokens
and the question's own words in the middle of its tokens, at the budget the shipped adapter uses
(``k = 6`` spans of ``l`` tokens, or ``--k``)::

    python benchmarks/scorer_cost.py --lengths 16384,131072 --layers 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {  # heads, kv heads, head dim, layers
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "qwen2.5-3b": (16, 2, 128, 36),
    "qwen2.5-7b": (28, 4, 128, 28),
}


def _model(heads: int, kv_heads: int, dim: int, layers: int):
    """A one-layer Qwen2 of the shape's attention (the scorers read its RoPE and its layer count)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * dim,
                         intermediate_size=64, num_hidden_layers=1, vocab_size=16, max_position_embeddings=131072)
    model = Qwen2ForCausalLM(config).eval()
    model.config.num_hidden_layers = layers  # only the count matters to the scorers
    return model


def _cache(model, n: int, interval: int, kv_heads: int, dim: int, layers: int):
    from acre_train.modeling.bilayer import BiLayerCache, CacheSettings

    m = n // interval
    gen = torch.Generator().manual_seed(0)
    l1 = torch.randn(layers, kv_heads, m, dim, generator=gen)
    return BiLayerCache(settings=CacheSettings(4096, 2048, interval), fingerprint="", l1_keys=l1, l1_keys_rot=l1,
                        l1_values=l1, l2_keys=torch.randn(layers, kv_heads, n, dim, generator=gen), l2_values=l1[:, :, :0],
                        span_bounds=torch.arange(0, n + 1, interval), tail_ids=[], carry=0, num_context_tokens=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-0.5b")
    parser.add_argument("--lengths", default="8192,16384,32768,65536")
    parser.add_argument("--interval", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1, help="scoring layers")
    parser.add_argument("--question", type=int, default=32, help="question tokens")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--k", type=int, default=6, help="spans refilled (the selection table's budget)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from acre_train.modeling.ranking import QuestionQueries, rank_spans
    from acre_train.modeling.scorer_spec import ScorerSettings

    heads, kv_heads, dim, n_layers = SHAPES[args.shape]
    model = _model(heads, kv_heads, dim, n_layers)
    layers = tuple(range(2, 2 + args.layers))
    print(f"{args.shape}: {heads} heads / {kv_heads} KV heads x {dim}, interval {args.interval}, "
          f"{args.layers} scoring layer(s), {args.question}-token question, {args.threads} threads")
    print(f"{'tokens':>7} | {'scorer':6} | {'ms/question':>11} | {'kept MiB':>8} | {'read MiB':>8}")
    for n in (int(x) for x in args.lengths.split(",")):
        cache = _cache(model, n, args.interval, kv_heads, dim, n_layers)
        q = torch.randn(heads, args.question, dim)
        queries = QuestionQueries({x: q for x in layers}, torch.arange(args.question) + cache.num_l1,
                                  torch.arange(args.question) + n)
        for kind in ("l1", "l2", "bounds"):
            scorer = ScorerSettings(kind, layers, "max")
            tic = time.perf_counter()
            rank_spans(model, cache, queries, scorer)  # bounds: builds the boxes (cache build time)
            first = time.perf_counter() - tic
            times = []
            for _ in range(args.repeat):
                tic = time.perf_counter()
                rank_spans(model, cache, queries, scorer)
                times.append(time.perf_counter() - tic)
            kept = sum(a.numel() * 4 * 2 for a, _ in cache.boxes.values()) / 2**20 if kind == "bounds" else 0.0
            read = args.layers * kv_heads * n * dim * cache.l2_keys.element_size() / 2**20 if kind == "l2" else 0.0
            note = f"  (boxes built once in {1000 * first:.0f} ms)" if kind == "bounds" else ""
            if kind == "l2":
                kept = sum(made.numel() * made.element_size() for _, made in cache.rotated.values()) / 2**20
            print(f"{n:>7} | {kind:6} | {1000 * statistics.median(times):>11.1f} | {kept:>8.2f} | {read:>8.2f}{note}")
    print()
    selection_table(args, model, layers)


# Every selection option the engine runs (scorer spec, refill overrides); "shipped" is the shipped card's.
OPTIONS = {
    "whole spans": ("l2:layers={L},heads=max", {}),
    "+neighbors": ("l2:layers={L},heads=max", {"neighbors": True}),
    "+sinks=4,keep_sinks=1": ("l2:layers={L},heads=max,sinks=4,keep_sinks=1", {}),
    "+query=question": ("l2:layers={L},heads=max,query=question", {}),
    "grow=1 (attention)": ("l2:layers={L},heads=max", {"grow": 1}),
    "grow=3 centered": ("l2:layers={L},heads=max", {"grow": 3, "grow_shape": "centered"}),
    "grow=1 densest": ("l2:layers={L},heads=max", {"grow": 1, "grow_shape": "densest"}),
    "grow=1 sentences": ("l2:layers={L},heads=max", {"grow": 1, "grow_shape": "sentences"}),
    "keep_sinks=tokens,unscored=8": ("l2:layers={L},heads=max,sinks=4,keep_sinks=tokens,unscored=8",
                                     {"grow": 1, "grow_shape": "sentences"}),
    "shipped": ("l2:layers={L},heads=max,sinks=4,keep_sinks=1,query=question", {"grow": 1, "grow_shape": "sentences"}),
}


def selection_table(args, model, layers: tuple[int, ...]) -> None:
    """ms per question of ``choose_refill`` for every option in :data:`OPTIONS`."""
    from acre_train.modeling.ranking import QuestionQueries, choose_refill
    from acre_train.modeling.scorer_spec import ScorerSettings

    heads, kv_heads, dim, n_layers = SHAPES[args.shape]
    names = list(OPTIONS)
    print("selection option (choose_refill: rank + choose; k = "
          f"{args.k} spans of {args.interval} tokens), ms per question")
    print(f"{'tokens':>7} | " + " | ".join(f"{name:>13.13}" for name in names))
    spec_layers = "+".join(str(x) for x in layers)
    for n in (int(x) for x in args.lengths.split(",")):
        cache = _cache(model, n, args.interval, kv_heads, dim, n_layers)
        cache.sentence_ends = torch.rand(n, generator=torch.Generator().manual_seed(1)) < 1 / 24
        q = torch.randn(heads, args.question, dim)
        own = torch.zeros(args.question, dtype=torch.bool)
        own[args.question // 4 : 3 * args.question // 4] = True
        cells = []
        for name in names:
            spec, extra = OPTIONS[name]
            scorer = ScorerSettings.parse(spec.format(L=spec_layers))
            times = []
            for _ in range(args.repeat + 1):  # the first makes the rotated keys (once per cache): not counted
                queries = QuestionQueries({x: q for x in layers}, torch.arange(args.question) + cache.num_l1,
                                          torch.arange(args.question) + n, own=own)
                tic = time.perf_counter()
                choose_refill(model, cache, queries, scorer, args.k, neighbors=extra.get("neighbors", False),
                              grow=extra.get("grow", 0), grow_shape=extra.get("grow_shape", "attention"))
                times.append(time.perf_counter() - tic)
            cells.append(1000 * statistics.median(times[1:]))
        print(f"{n:>7} | " + " | ".join(f"{c:>13.1f}" for c in cells))


if __name__ == "__main__":
    main()
