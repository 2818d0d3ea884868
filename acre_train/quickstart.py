"""``acre-train quickstart``: ACRE answering for real, then (``--tiny``) the whole path on a tiny model.

By default it answers for real, with no training: it fetches the pretrained Qwen2.5-Coder-0.5B-Instruct
(``acre-train base fetch qwen2.5-coder-0.5b-instruct``, skipped when present), exports the LoRA L1
adapter that ships with acre-train (trained in docs/real-base.md) with the geometry and calibrated
refill scorer recorded beside it (``resources/adapters/*.json``), builds one bi-layer cache over a
~2K-token context of SQuAD articles that adapter never saw, and answers several questions from it;
full attention answers the same questions beside it, with the share of the KV each attended and the
time each took.

``--tiny`` runs the mechanics on a tiny random model instead (nothing is downloaded):

1. prepare the built-in data (Python Language Reference text, a SQuAD sample) and train stage 1
   (``recipes/tiny_stage1.yaml``) on a tiny Qwen2-architecture model;
2. train stage 2 (``recipes/tiny_stage2.yaml``) from the stage-1 L1 weights;
3. export the result as an inference-ready Hugging Face folder;
4. build a bi-layer cache for a long built-in text and answer a question with refilling.

Each step prints what it did and what it cost. The tiny base has random weights, so its answer is
noise: it shows the mechanics and their cost. Everything lands in ``--output`` (default
``checkpoints/quickstart``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parent / "recipes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="checkpoints/quickstart", help="where runs, data and the export go")
    parser.add_argument("--questions", type=int, default=4, help="questions asked of the one context (default 4)")
    parser.add_argument("--tiny", action="store_true",
                        help="the whole path on a tiny random model instead: data, stage 1, stage 2, export, a "
                             "refilled answer (no download, about a minute)")
    parser.add_argument("--real", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    g = parser.add_argument_group("--tiny")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps per training stage (default 20)")
    g.add_argument("--context-paragraphs", type=int, default=None,
                   help="built-in SQuAD paragraphs joined into the long context (default 40)")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    return _tiny(args) if args.tiny else _real(args)


def check_arguments(args: argparse.Namespace) -> None:
    """Every argument problem before any work starts (a bad value never surfaces minutes in)."""
    if not str(args.output).strip():
        raise ValueError("--output is empty; name the folder for the runs, data and export")
    if Path(args.output).exists() and not Path(args.output).is_dir():
        raise ValueError(f"--output {args.output} is a file, not a folder")
    if args.questions < 1:
        raise ValueError(f"--questions must be >= 1, got {args.questions}")
    for flag, value in (("--steps", args.steps), ("--context-paragraphs", args.context_paragraphs)):
        if value is not None and not args.tiny:
            raise ValueError(f"{flag} applies to the --tiny path only (the real path uses the shipped adapter)")
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def _tiny(args: argparse.Namespace) -> int:
    args.steps, args.context_paragraphs = args.steps or 20, args.context_paragraphs or 40
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
    from .export import export_run

    export_run(run_dir, export_dir, overwrite=True)


def _answer(export_dir: Path, paragraphs: int) -> None:
    from .data.builtin import builtin_qa
    from .infer.load import load_export
    from .infer.settings import inference_settings
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


# ------------------------------------------------------------------------------------ real

REAL_BASE = "qwen2.5-coder-0.5b-instruct"
# In acre_train/resources, each with a card (NAME.json) beside it. The quickstart's: stage 1 + 2 at
# 120 + 120 steps, stage 2 in the refilled layout, with its scorer calibrated on training-article SQuAD
# (one region of whole sentences over layers 7+9, ranked by the question's own words; docs/real-base.md).
SHIPPED_ADAPTER = "adapters/qwen2.5-0.5b-stage2-sim-lora-120.safetensors"
STAGE1_ADAPTER = "adapters/qwen2.5-0.5b-stage1-lora.safetensors"
REAL_CONTEXT_TOKENS = 2048
REAL_SEED = 777  # the study's evaluation seed: questions never used in training


def shipped_card(adapter: str = SHIPPED_ADAPTER) -> dict:
    """What ships beside an adapter (``NAME.json``): its base, the recipe that names its L1 form, and the
    inference settings it is meant to run with (geometry and the calibrated refill scorer)."""
    import json
    from importlib.resources import files

    card = files("acre_train.resources").joinpath(adapter.removesuffix(".safetensors") + ".json")
    return json.loads(card.read_text(encoding="utf-8"))


def shipped_adapter_export(out_dir: Path, adapter: str = SHIPPED_ADAPTER) -> Path:
    """An adapter-only export of a shipped adapter on the fetched base, with the inference settings
    of its card (geometry and calibrated scorer); made once, reused after."""
    from importlib.resources import files

    from .base.fetch import resolve_source
    from .data.tokenizer import auto_tokenizer
    from .export import export_model
    from .export.checkpoint import model_from_adapter
    from .train import load_recipe

    card = shipped_card(adapter)
    base = resolve_source(f"base:{card['base']}")  # not fetched: an error that names the fetch command
    settings = json.dumps(card["inference"], sort_keys=True)
    if (out_dir / "config.json").is_file():
        stored = json.loads((out_dir / "config.json").read_text(encoding="utf-8")).get("acre", {}).get("source", {})
        if stored.get("card_inference") == settings:
            return out_dir
        overwrite = True  # the card's settings changed since this export was made: make it again
    else:
        overwrite = False
    recipe = load_recipe(RECIPES / f"{card['recipe']}.yaml", [])
    weights = files("acre_train.resources").joinpath(adapter)
    model = model_from_adapter(base, str(weights), l1=recipe.model.l1, lora=recipe.model.lora.model_dump())
    scorer = None
    if card.get("learned_scorer"):  # the card's learned scorer (modeling/learned_scorer.py) travels with the export
        from .modeling.learned_scorer import QueryMap
        from .modeling.scorer_spec import ScorerSettings

        path = files("acre_train.resources").joinpath(f"adapters/{card['learned_scorer']['file']}")
        scorer = (QueryMap.load(str(path)), ScorerSettings.parse(card["inference"]["scorer"]).describe())
    return export_model(model, out_dir, tokenizer=auto_tokenizer(base), adapter_only=True, base_model=base,
                        inference=card["inference"], scorer=scorer,
                        source={"adapter": f"acre_train/resources/{adapter}", "stage": card.get("stage"),
                                "card_inference": settings}, overwrite=overwrite)


def held_out_squad(out: Path) -> Path:
    """The built-in SQuAD sample's odd-index articles (the study trains on even ones) as a SQuAD file."""
    from importlib.resources import files

    from .data.squad import split_articles, subset_squad

    sample = Path(str(files("acre_train.resources").joinpath("squad_v2_sample.json")))
    _, held = split_articles(sample)
    return subset_squad(sample, held, out)


def _real(args: argparse.Namespace) -> int:
    import torch

    from .base.fetch import fetch
    from .eval.harness import EvalConfig, evaluate
    from .eval.methods import parse_methods
    from .eval.tasks import build_task
    from .infer.load import load_export

    out = Path(args.output)
    timings: dict[str, float] = {}
    _timed(timings, f"base {REAL_BASE}", lambda: fetch(REAL_BASE))
    export_dir = _timed(timings, "export the shipped adapter", lambda: shipped_adapter_export(out / "export-real"))
    model, tokenizer, _ = load_export(export_dir, dtype=torch.float32)
    squad = held_out_squad(out / "squad-heldout.json")
    examples = build_task("squad", tokenizer, REAL_CONTEXT_TOKENS, args.questions, REAL_SEED, squad_path=squad,
                          questions_per_context=args.questions)
    report = _timed(timings, f"answer {len(examples)} questions (full vs acre)", lambda: evaluate(
        model, tokenizer, examples, parse_methods("full,acre"), config=EvalConfig(16, progress=False)))
    scorer = report.rows[[r["method"] for r in report.rows].index("acre")]["acre_scorer"]
    contexts = len({ex.meta.get("context_id", ex.id) for ex in examples})
    print(f"\n{len(examples)} questions on {contexts} cache(s) of ~{REAL_CONTEXT_TOKENS} tokens of held-out SQuAD; "
          f"acre refills with {scorer}; times are per question (the context's prefill is not counted)")
    for ex in examples:
        rows = {r["method"]: r for r in report.rows if r["id"] == ex.id}
        print(f"Q: {ex.question}   (gold: {ex.answers[0]})")
        for method in ("full", "acre"):
            r = rows[method]
            print(f"   {method:5s} {r['prediction']!r:45s} F1 {100 * r['score']:5.1f}  "
                  f"KV {r['kv_attended'] / r['prompt_tokens']:5.1%}  {r['answer_s']:.2f}s")
    print("\n== done: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    print(f"   export: {export_dir}   try: acre-train chat {export_dir} --context FILE")
    return 0
