"""Dev only: answer the long suite's dev questions under several selections, one cache per context.

    python -m studies.long.dev_answers --task long_needles --length 16384 --contexts 2 \\
        --select "l2:layers=7+9,heads=max,sinks=4,keep_sinks=first,query=question +grow=8,sentences eta=512" \\
        --select "l2:layers=7+9,heads=max,sinks=4,keep_sinks=first,query=question +grow=1,sentences eta=192"

Prints, per selection, the answer-contained rate, and writes every answer to ``--out`` (JSONL). Never run on the test split: it has no --split.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    import torch

    from acre_train.eval.long_tasks import build_long_task
    from acre_train.eval.metrics import substring_match
    from acre_train.infer import AcreEngine, save_cache
    from acre_train.infer.load import load_export
    from acre_train.infer.settings import inference_settings
    from acre_train.modeling.selection import Selection

    parser = argparse.ArgumentParser(prog="python -m studies.long.dev_answers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", default="checkpoints/long/shipped-export")
    parser.add_argument("--task", default="long_needles")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--contexts", type=int, default=2)
    parser.add_argument("--select", action="append", required=True, help="a selection (docs/selection.md)")
    parser.add_argument("--squad", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default="checkpoints/long/dev-answers.jsonl")
    parser.add_argument("--caches", default=None, metavar="DIR",
                        help="keep each context's cache here and load it on a later run (a 16K build takes minutes)")
    args = parser.parse_args(argv)

    model, tok, data = load_export(args.export, dtype=torch.float32)
    cache_settings, refill = inference_settings(data)
    engine = AcreEngine(model, tok, cache_settings=cache_settings, refill=refill.replace(max_new_tokens=args.max_new_tokens))
    selections = [Selection.parse(s) for s in args.select]
    examples = build_long_task(args.task, tok, args.length, args.contexts, "dev", squad_path=args.squad)
    tally = {s.describe(): [0, 0] for s in selections}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for cid in dict.fromkeys(e.meta["context_id"] for e in examples):
            group = [e for e in examples if e.meta["context_id"] == cid]
            tic = time.perf_counter()
            context = group[0].context if group[0].context is not None else "\n\n".join(group[0].documents)
            saved = Path(args.caches) / f"{cid}.safetensors" if args.caches else None
            if saved is not None and saved.is_file():
                cache = engine.load_cache(saved)
                print(f"{cid}: loaded {saved}", flush=True)
            else:
                cache = engine.build(f"{group[0].instruction}\n\n{context}" if group[0].instruction else context,
                                     progress=False)
                print(f"{cid}: built in {time.perf_counter() - tic:.0f}s", flush=True)
                if saved is not None:
                    save_cache(cache, saved)
            for e in group:
                for s in selections:
                    a = engine.answer(cache, e.question, **s.to_dict())  # the whole selection, every length
                    hit = substring_match(a.text, e.answers)
                    t = tally[s.describe()]
                    t[0] += hit
                    t[1] += 1
                    f.write(json.dumps({"context": cid, "question": e.question, "answers": e.answers,
                                        "selection": s.describe(), "answer": a.text, "contained": hit}) + "\n")
    for name, (hits, n) in tally.items():
        print(f"{100 * hits / n:5.1f} % answer contained ({n})  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
