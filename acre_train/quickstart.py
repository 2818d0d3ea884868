"""``acre-train quickstart``: the whole ACRE path on the embedded default, in a few minutes on a CPU.

1. prepare the built-in data (Python Language Reference text, a SQuAD sample) and train stage 1
   (``recipes/tiny_stage1.yaml``) on a tiny Qwen2-architecture model;
2. train stage 2 (``recipes/tiny_stage2.yaml``) from the stage-1 L1 weights;
3. export the result as an inference-ready Hugging Face folder;
4. build a bi-layer cache for a long built-in text and answer a question with refilling.

Each step prints what it did and what it cost. The base model has random weights (nothing can be
downloaded here), so the answer itself is noise: the quickstart shows the mechanics and their cost.
Everything lands in ``--output`` (default ``checkpoints/quickstart``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "recipes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="checkpoints/quickstart", help="where runs, data and the export go")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per training stage (default 20)")
    parser.add_argument("--context-paragraphs", type=int, default=40,
                        help="built-in SQuAD paragraphs joined into the long context (default 40)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.output)
    timings: dict[str, float] = {}
    stage1 = _timed(timings, "stage 1", lambda: _train("tiny_stage1.yaml", out, "quickstart-stage1", args.steps))
    stage2 = _timed(timings, "stage 2", lambda: _train("tiny_stage2.yaml", out, "quickstart-stage2", args.steps,
                                                        f"model.init_from={stage1}"))
    export_dir = out / "export"
    _timed(timings, "export", lambda: _export(stage2, export_dir))
    _timed(timings, "answer", lambda: _answer(export_dir, args.context_paragraphs))
    print("\n== done: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) + f" (total {sum(timings.values()):.1f}s)")
    print(f"   export: {export_dir}   try: acre-train chat {export_dir} --context FILE")
    return 0


def _timed(timings: dict[str, float], name: str, fn):
    print(f"\n== {name} " + "=" * (70 - len(name)))
    start = time.perf_counter()
    result = fn()
    timings[name] = time.perf_counter() - start
    return result


def _train(recipe_name: str, out: Path, run_name: str, steps: int, *extra: str) -> Path:
    from .train import load_recipe, train, validate_recipe

    overrides = [f"run_name={run_name}", f"output_root={out}", f"data.path={out}/data/{run_name}",
                 f"train.max_steps={steps}", "checkpoint.every_steps=null",
                 "checkpoint.overwrite=true", *extra]  # the quickstart re-runs from scratch every time
    recipe = validate_recipe(load_recipe(RECIPES / recipe_name, overrides))
    result = train(recipe)
    print(f"{run_name}: {result.steps} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
          f"{result.tokens_per_s:,.0f} tokens/s, checkpoint {result.last_checkpoint}")
    return result.run_dir


def _export(run_dir: Path, export_dir: Path) -> None:
    from .cli import main

    if main(["export", str(run_dir), str(export_dir), "--overwrite"]) != 0:
        raise SystemExit("export failed (see above)")


def _answer(export_dir: Path, paragraphs: int) -> None:
    from .data.builtin import builtin_qa
    from .infer.load import load_export
    from .modeling.geometry import inference_settings
    from .infer import AcreEngine

    model, tokenizer, data = load_export(export_dir)
    cache_settings, refill = inference_settings(data, {"max_new_tokens": 16})
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    contexts, question, gold = _long_context(builtin_qa(), paragraphs)

    start = time.perf_counter()
    cache = engine.build("\n\n".join(contexts), progress=False)
    build_s = time.perf_counter() - start
    answer = engine.answer(cache, question)
    print(f"context: {paragraphs} built-in SQuAD paragraphs; settings {cache_settings}")
    print(f"cache:   {cache.summary()} (built in {build_s:.2f}s)")
    print(f"question: {question}   (gold: {gold})")
    print(f"answer:   {answer.text!r}")
    print(f"refill:   {answer.describe()}")


def _long_context(qa: dict, paragraphs: int) -> tuple[list[str], str, str]:
    """The first ``paragraphs`` contexts of the built-in sample, and a question about the middle one."""
    flat = [p for article in qa["data"] for p in article["paragraphs"]][:paragraphs]
    middle = flat[len(flat) // 2]
    qa_item = next(q for q in middle["qas"] if q.get("answers"))
    return [p["context"] for p in flat], qa_item["question"], qa_item["answers"][0]["text"]
