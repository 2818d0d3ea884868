"""``acre-train quickstart``: the whole ACRE path on the shipped miniature base, in a few minutes on a CPU.

1. write small stage-1/stage-2 streams with the miniature study's generators (long needle-in-text
   documents, long-context QA), tokenized with the base's own tokenizer;
2. train stage 1 (``recipes/mini/stage1.yaml``) on the base shipped in
   ``acre_train/resources/mini_base`` (~4M parameters, 1,024-token window, trained here from scratch:
   docs/miniature.md), then stage 2 (``recipes/mini/stage2.yaml``) from the stage-1 L1 weights;
3. export the result as an inference-ready Hugging Face folder;
4. build a bi-layer cache for a 4K-token needle text (4x the base window, a seed never used in
   training) and answer its question with refilling, next to full attention over the same prompt.

Each step prints what it did and what it cost. With the default 20 steps per stage the adapter is
barely trained: the answer shows the mechanics; ``acre-train reproduce mini`` trains it properly.
Everything lands in ``--output`` (default ``checkpoints/quickstart``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
MINI_BASE = Path(__file__).resolve().parent / "resources" / "mini_base"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="checkpoints/quickstart", help="where runs, data and the export go")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per training stage (default 20)")
    parser.add_argument("--context-tokens", type=int, default=4096,
                        help="length of the needle text answered at the end (default 4096 = 4x the base window)")


def run(args: argparse.Namespace) -> int:
    out = Path(args.output).resolve()
    if not (RECIPES / "mini" / "stage1.yaml").is_file():
        raise SystemExit(f"the quickstart needs the repository's recipes/ folder (looked in {RECIPES}); "
                         "install acre-train from a clone with 'pip install -e .'")
    timings: dict[str, float] = {}
    streams = _timed(timings, "data", lambda: _streams(out / "streams"))
    stage1 = _timed(timings, "stage 1", lambda: _train(
        "stage1.yaml", out, "quickstart-stage1", args.steps, streams["stage1"],
        "data.prepare.min_length=2048", "data.prepare.max_length=2048"))
    stage2 = _timed(timings, "stage 2", lambda: _train(
        "stage2.yaml", out, "quickstart-stage2", args.steps, streams["stage2"], f"model.init_from={stage1}",
        "data.prepare.max_length=2048"))
    export_dir = out / "export"
    _timed(timings, "export", lambda: _export(stage2, export_dir))
    _timed(timings, "answer", lambda: _answer(export_dir, args.context_tokens))
    print("\n== done: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()) + f" (total {sum(timings.values()):.1f}s)")
    print(f"   export: {export_dir}   try: acre-train chat {export_dir} --context FILE")
    return 0


def _timed(timings: dict[str, float], name: str, fn):
    print(f"\n== {name} " + "=" * (70 - len(name)))
    start = time.perf_counter()
    result = fn()
    timings[name] = time.perf_counter() - start
    return result


def _streams(folder: Path) -> dict[str, Path]:
    """Stage-1 documents (2,048 tokens: a long retrieval example + text) and stage-2 conversations."""
    from transformers import AutoTokenizer

    from .mini.data import StreamSettings, stage1_documents, stage2_conversations, write_jsonl

    tok = AutoTokenizer.from_pretrained(str(MINI_BASE))
    s = StreamSettings(window=1024, long_window=2048, stage1_docs=40, stage2_samples=80, stage2_max_context=1600)
    paths = {"stage1": folder / "stage1.jsonl", "stage2": folder / "stage2.jsonl"}
    n1 = write_jsonl(stage1_documents(tok, s, set()), paths["stage1"])
    n2 = write_jsonl(stage2_conversations(tok, s, set()), paths["stage2"])
    print(f"{n1} stage-1 documents, {n2} stage-2 conversations -> {folder}")
    return paths


def _train(recipe_name: str, out: Path, run_name: str, steps: int, stream: Path, *extra: str) -> Path:
    from .train import load_recipe, train, validate_recipe

    overrides = [f"run_name={run_name}", f"output_root={out}", f"data.path={out}/data/{run_name}",
                 f"data.prepare.inputs=[{stream}]", f"data.prepare.tokenizer={MINI_BASE}",
                 f"model.source={MINI_BASE}", f"train.max_steps={steps}", "checkpoint.every_steps=null",
                 "logging.every_steps=5", *extra]
    recipe = validate_recipe(load_recipe(RECIPES / "mini" / recipe_name, overrides))
    result = train(recipe)
    print(f"{run_name}: {result.steps} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
          f"{result.tokens_per_s:,.0f} tokens/s, checkpoint {result.last_checkpoint}")
    return result.run_dir


def _export(run_dir: Path, export_dir: Path) -> None:
    from .cli import main

    if main(["export", str(run_dir), str(export_dir), "--overwrite"]) != 0:
        raise SystemExit("export failed (see above)")


def _answer(export_dir: Path, context_tokens: int) -> None:
    """A multi-key needle question over ``context_tokens`` tokens: ACRE with refilling vs full attention."""
    import torch

    from .eval.prompt import prepare_example
    from .eval.tasks import build_task
    from .export.load import load_export, settings_from_export
    from .infer import AcreEngine
    from .mini.data import EVAL_SEED

    model, tokenizer, data = load_export(export_dir)
    cache_settings, refill = settings_from_export(data, {"max_new_tokens": 10})
    engine = AcreEngine(model, tokenizer, cache_settings=cache_settings, refill=refill)
    example = build_task("niah_multikey", tokenizer, context_tokens, 1, EVAL_SEED + 2)[0]
    prepared = prepare_example(tokenizer, example)
    context_ids = [*prepared.prefix_ids, *(t for d in prepared.doc_ids for t in d)]

    start = time.perf_counter()
    cache = engine.build(context_ids, progress=False)
    build_s = time.perf_counter() - start
    answer = engine.answer(cache, prepared.suffix_ids)
    prompt = torch.tensor([prepared.prompt_ids()])
    with torch.no_grad():  # the same prompt with plain full attention: past the base's 1,024-token window
        full = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    full_text = tokenizer.decode(full[0, prompt.shape[1]:], skip_special_tokens=True)
    gold = example.answers[0]
    print(f"context: {len(prepared)} tokens, 4 needles over Python-reference text; settings {cache_settings}")
    print(f"cache:   {cache.summary()} (built in {build_s:.2f}s)")
    print(f"question: {example.question}   (gold: {gold})")
    print(f"ACRE:     {answer.text.strip()!r} {'correct' if gold in answer.text else 'wrong'}")
    print(f"full:     {full_text.strip()!r} {'correct' if gold in full_text else 'wrong'} (full attention, "
          f"{len(prepared)} tokens > the base's {model.config.max_position_embeddings}-token window)")
    print(f"refill:   {answer.describe()}")
