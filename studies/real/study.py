"""``acre-train reproduce real``: ACRE trained and evaluated on the real 0.5B base, one resumable command.

Steps (each skipped when its output exists, so the command continues where it stopped):

* ``streams``  training inputs split from the evaluation by SQuAD article (``streams.py``);
* ``corpus``   the larger training data: >= 1M stage-1 tokens, 1,200 stage-2 conversations (``corpus.py``);
* ``stage1``, ``stage2``  ``acre-train train recipes/qwen2.5-0.5b/stageN.yaml`` with resume=latest;
* ``stage2-refill``  stage 2 again from stage 1, same data and steps, plus the refill loss
                     (``recipes/qwen2.5-0.5b/stage2-refill.yaml``, ``train/refill_loss.py``, weight 1);
* ``stage2-refill-light``  the same with the refill loss at weight 0.1;
* ``stage1-full``, ``stage2-full``  stage 1 and 2 again with full-copy L1 projections instead of LoRA
                     (``model.l1=full``, the paper's lr 5e-5), same data, steps and order;
* ``stage1-long``, ``stage2-long``  the LoRA runs with 4x / 6x the steps (120 each: ~1.5 h and ~0.7 h
                     on 2 cores, as measured; ~3 and ~2.5 epochs of the same data);
* ``stage2-sim-long``  stage2-long again (same start, data, order, lr, steps) in the refilled layout
                     (``recipes/qwen2.5-0.5b/stage2-sim.yaml``, ``train/refill_sim.py``);
* ``stage1-distill``, ``stage2-sim-distill``  stage1-long (60 steps) and stage2-sim-long with half the loss
                     a KL to the frozen base under full attention (``train.distill``);
* ``export``   adapter-only exports of stage 0 (untrained L1 = copies of the base), stage 1, stage 1+2;
* ``eval``     one cell per (context length, task, model): ``evaluate`` into ``eval/<len>/<task>/<model>/``,
               written atomically, so an interrupted evaluation redoes at most one cell;
* ``report``   ``report.md`` (+ ``report.json``, plot) with 95 % bootstrap intervals.

Evaluation settings are fixed here, before any result: seeds, lengths, questions per context, the
ACRE inference geometry and refill budget; ``truncated`` gets the budget the ``acre`` row attended.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from acre_train.modeling.geometry import WindowGeometry
from acre_train.train.recipe import PACKAGED_RECIPES
from acre_train.data.squad import subset_squad

from .streams import EVAL_SEED, split_articles, stage2_conversations, write_jsonl, write_text_mix

BASE = "base:qwen2.5-coder-0.5b-instruct"
FULL_COPY = ("model.l1=full", "train.learning_rate=5e-5")  # the paper's lr for full L1 copies


@dataclass(frozen=True)
class Run:
    """One training run of the study: how it is trained and the report rows its export answers.

    ``recipe`` names ``recipes/qwen2.5-0.5b/<recipe>.yaml``; ``overrides`` make the variant;
    ``start`` is the run whose L1 weights it starts from (or that run's export on another machine);
    ``rows`` maps each evaluated method to its row name in the report; ``data`` names the streams file
    it trains on (default: the recipe stage's own, ``text-mix.jsonl`` or ``stage2.jsonl``).
    """

    dir: str
    recipe: str
    rows: dict[str, str]
    overrides: tuple[str, ...] = ()
    start: str | None = None
    data: str | None = None


def _acre(label: str) -> dict[str, str]:
    return {"acre": f"acre, {label}"}


RUNS: dict[str, Run] = {
    "stage1": Run("qwen2.5-0.5b-stage1-lora", "stage1", _acre("stage 1")),
    "stage2": Run("qwen2.5-0.5b-stage2-lora", "stage2",
                  {"acre": "acre, stage 1+2", "acre-l1": "acre-l1, stage 1+2"}, start="stage1"),
    "stage2-refill": Run("qwen2.5-0.5b-stage2-refill-lora", "stage2-refill", _acre("stage 1+2 refill-aware"),
                         start="stage1"),
    "stage2-refill-light": Run("qwen2.5-0.5b-stage2-refill0.1-lora", "stage2-refill",
                               _acre("stage 1+2 refill-aware (weight 0.1)"),
                               ("train.refill_loss.weight=0.1",), start="stage1"),
    "stage1-full": Run("qwen2.5-0.5b-stage1-full", "stage1", _acre("stage 1 (full-copy L1)"), FULL_COPY),
    "stage2-full": Run("qwen2.5-0.5b-stage2-full", "stage2", _acre("stage 1+2 (full-copy L1)"), FULL_COPY,
                       start="stage1-full"),
    "stage1-long": Run("qwen2.5-0.5b-stage1-lora-120", "stage1", _acre("stage 1 (120 steps)"),
                       ("train.max_steps=120",)),
    "stage2-long": Run("qwen2.5-0.5b-stage2-lora-120", "stage2", _acre("stage 1+2 (120 + 120 steps)"),
                       ("train.max_steps=120",), start="stage1-long"),
    # The training issue's row: stage2-long's data, order, seed, lr and steps, in the refilled layout.
    "stage2-sim-long": Run("qwen2.5-0.5b-stage2-sim-lora-120", "stage2-sim",
                           _acre("stage 1+2 refill-simulated (120 + 120 steps)"), ("train.max_steps=120",),
                           start="stage1-long"),
    # The training issue's distilled row: stage1-long's data, order, seed and lr, half its steps, the loss
    # weight * KL(base with full attention || ACRE) + (1 - weight) * CE (CEPE's KL x2 + LM is weight 2/3).
    "stage1-distill": Run("qwen2.5-0.5b-stage1-distill-lora-60", "stage1", _acre("stage 1 distilled (60 steps)"),
                          ("train.max_steps=60", "train.distill.weight=0.5")),
    # The training issue's last row: stage2-sim-long (same start, data, order, lr, steps) plus the same KL to
    # the frozen base on the answer tokens, so that the pair isolates what distillation adds in stage 2.
    "stage2-sim-distill": Run("qwen2.5-0.5b-stage2-sim-distill-lora-120", "stage2-sim",
                              _acre("stage 1+2 refill-simulated + distilled (120 + 120 steps)"),
                              ("train.max_steps=120", "train.distill.weight=0.5"), start="stage1-long"),
    # The training issue's item 4: one epoch of the 1M-token corpus (``corpus`` step), spans of 2K-8K tokens
    # so that the 4K and 8K cells are within training lengths; 3 % held out for a stage-1 loss that tells
    # memorisation from better summaries (240 spans, 7 held out: 116 steps of 2). Checkpointed recomputation
    # keeps an 8K span within this machine's memory.
    "stage1-corpus": Run("qwen2.5-0.5b-stage1-corpus-lora", "stage1", _acre("stage 1 (1M-token corpus, 1 epoch)"),
                         ("train.max_steps=116", "data.prepare.min_length=2048",
                          "data.prepare.max_length=8192", "data.prepare.token_budget=null", "data.eval_split=0.03",
                          "train.eval_every=25", "model.gradient_checkpointing=true", "checkpoint.every_steps=1",
                          "checkpoint.keep_last=2"),
                         data="stage1-corpus.jsonl"),
}
STEPS = ("streams", "corpus", *RUNS, "export", "eval", "report")
STREAMS_VERSION = 2  # 2: stage-2 conversations carry their evidence (character ranges of the answer's support)
# Model groups of the evaluation, in the order they run: method -> row name in the report.
MODELS: dict[str, dict[str, str]] = {
    "stage0": {"acre": "acre, stage 0 (untrained L1)", "acre-l1": "acre-l1, stage 0 (untrained L1)"},
    "base": {"full": "full", "truncated": "truncated", "cachefocus": "cachefocus", "infoflow": "infoflow"},
    **{name: run.rows for name, run in RUNS.items()},
}


@dataclass
class RealConfig:
    """What sizes the evaluation (fixed before results); ``smoke()`` runs the driver on a tiny model."""

    lengths: tuple[int, ...] = (2048, 4096)
    tasks: tuple[str, ...] = ("squad", "niah_multikey")
    questions: int = 40
    questions_per_context: int = 4
    # Answer budget per task. SQuAD answers are short spans; the instruct base restates a multikey
    # question before the 7-digit number ("The special magic number for ... is 8..."), which 16 tokens cut.
    max_new_tokens: dict[str, int] = field(default_factory=lambda: {"squad": 16, "niah_multikey": 48})
    cachefocus: str = "cachefocus"  # the paper's n=4 pruning interval (smoke: n=1 on a 2-layer model)
    inference: WindowGeometry = field(default_factory=lambda: WindowGeometry(
        first_chunk=1024, stride=512, intervals=(32,), working_window=32768, max_refill=192))
    stage2_conversations: int = 96
    stage2_lengths: tuple[int, ...] = (1024, 1536, 2048, 2560)
    # The larger training data (corpus.py): stage-1 tokens, stage-2 conversations and their lengths.
    corpus_tokens: int = 1_000_000
    corpus_conversations: int = 1200
    corpus_lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    base: str = BASE
    recipes: str = str(PACKAGED_RECIPES / "qwen2.5-0.5b")  # the product's CPU-sized real-base recipes
    overrides: tuple[str, ...] = ()  # extra key=value for both training runs (smoke: tiny sizes)
    # Kept L1 weights (``acre_adapter.safetensors`` of an adapter-only export) per model, used by the
    # export step when the run's checkpoints are gone (a fresh machine): {"stage1": "path", ...}.
    adapters: dict[str, str] = field(default_factory=dict)
    # Cells to evaluate, in order, as "LENGTH/TASK[/MODEL]" (default: every cell); the report keeps the
    # earlier summary of a cell whose folder is gone (see report.py).
    cells: tuple[str, ...] = ()

    @classmethod
    def smoke(cls, base: str) -> "RealConfig":
        return cls(lengths=(300,), tasks=("squad", "niah_multikey"), questions=2, questions_per_context=2,
                   max_new_tokens={"squad": 3, "niah_multikey": 3}, cachefocus="cachefocus:n=1",
                   inference=WindowGeometry(first_chunk=64, stride=32, intervals=(8,), working_window=4096, max_refill=32),
                   stage2_conversations=4, stage2_lengths=(200,), corpus_tokens=2000, corpus_conversations=4,
                   corpus_lengths=(200,), base=base,
                   overrides=(f"model.source={base}", f"data.prepare.tokenizer={base}", "train.max_steps=1",
                              "checkpoint.every_steps=1", "data.prepare.first_chunk=64", "data.prepare.stride=32",
                              "data.prepare.min_length=128", "data.prepare.max_length=256",
                              "train.refill_sim.interval=8", "train.refill_sim.max_refill=32",
                              "train.refill_sim.scorer=l2:layers=-1,heads=max",
                              "logging.progress_bar=false"))


class RealStudy:
    def __init__(self, root: str | Path, squad: str | Path | None, config: RealConfig | None = None,
                 log: Callable[[str], None] = print):
        self.root = Path(root)
        self.squad = Path(squad) if squad else None
        self.config = config or RealConfig()
        self.log = log

    # -------------------------------------------------------------------------------- paths

    @property
    def streams(self) -> Path:
        return self.root / "streams"

    def run_dir(self, stage: str) -> Path:
        return self.root / "runs" / RUNS[stage].dir

    def export_dir(self, model: str) -> Path:
        return self.root / "exports" / model

    def cell_dir(self, length: int, task: str, model: str) -> Path:
        return self.root / "eval" / str(length) / task / model

    # ------------------------------------------------------------------------------ running

    def run(self, steps: tuple[str, ...] = STEPS) -> dict[str, float]:
        unknown = [s for s in steps if s not in STEPS]
        if unknown:
            raise ValueError(f"unknown step(s) {unknown}; steps: {', '.join(STEPS)}")
        timings = {}
        for step in STEPS:
            if step in steps:
                tic = time.time()
                if step in RUNS:
                    self._train(step)
                else:
                    getattr(self, "step_" + step)()
                timings[step] = round(time.time() - tic, 1)
        return timings

    def _need_squad(self) -> Path:
        if self.squad is None or not self.squad.is_file():
            raise FileNotFoundError("the real study needs the SQuAD v2 dev JSON: pass --squad PATH "
                                    f"(got {self.squad})")
        return self.squad

    def step_streams(self) -> None:
        from acre_train.data.tokenizer import auto_tokenizer

        out = self.streams
        if (out / "manifest.json").is_file():
            if json.loads((out / "manifest.json").read_text()).get("version") == STREAMS_VERSION:
                self.log(f"streams: {out} exists; skipped")
                return
            self.log(f"streams: {out} was written by an earlier version; rewriting (same seeds, same conversations)")
        squad = self._need_squad()
        train, held = split_articles(squad)
        subset_squad(squad, train, out / "squad-train.json")
        subset_squad(squad, held, out / "squad-heldout.json")
        write_text_mix(squad, out / "text-mix.jsonl")
        tok = auto_tokenizer(self.config.base)
        rows = stage2_conversations(tok, out / "squad-train.json", self.config.stage2_conversations,
                                    self.config.stage2_lengths)
        write_jsonl(rows, out / "stage2.jsonl")
        manifest = {"squad": str(squad), "train_articles": train, "heldout_articles": held,
                    "stage2_conversations": len(rows), "eval_seed": EVAL_SEED, "version": STREAMS_VERSION,
                    "with_evidence": sum(1 for r in rows if r["evidence"])}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        self.log(f"streams: wrote {out} ({len(train)} training / {len(held)} held-out SQuAD articles)")

    def _train(self, stage: str) -> None:
        from acre_train.train.checkpoint import latest_checkpoint, read_meta

        spec = RUNS[stage]
        recipe = Path(self.config.recipes) / f"{spec.recipe}.yaml"
        run = self.run_dir(stage)
        newest = latest_checkpoint(run) if run.is_dir() else None
        target = self._max_steps(recipe, spec.overrides)
        if newest is not None and read_meta(newest).get("step") == target:
            self.log(f"{stage}: finished ({newest}); skipped")
            return
        data = spec.data or ("text-mix.jsonl" if spec.recipe == "stage1" else "stage2.jsonl")
        if not (self.streams / data).is_file():
            raise FileNotFoundError(f"{stage} trains on {self.streams / data}: run the "
                                    f"{'corpus' if spec.data else 'streams'} step first")
        args = [sys.executable, "-m", "acre_train.cli", "train", str(recipe), f"output_root={run.parent}",
                f"run_name={run.name}", f"data.path={self.root / 'data' / stage}",
                f"data.prepare.inputs=[{self.streams / data}]", "checkpoint.resume_from_checkpoint=latest",
                *spec.overrides, *self.config.overrides]
        if spec.start:
            # Stage 1's run, or its export when the run is on another machine (kept L1 weights).
            start = self.run_dir(spec.start) if self._has_checkpoint(spec.start) else self.export_dir(spec.start)
            args.append(f"model.init_from={start}")
        self.log(f"{stage}: {' '.join(args[2:])}")
        subprocess.run(args, check=True)

    def _max_steps(self, recipe: Path, variant: tuple[str, ...] = ()) -> int | None:
        from acre_train.train.recipe import load_recipe

        pairs = [o for o in (*variant, *self.config.overrides) if o.startswith("train.max_steps=")]
        return load_recipe(recipe, pairs).train.max_steps

    def step_corpus(self) -> None:
        """The larger training data (corpus.py): >= 1M stage-1 tokens and >= 1,000 stage-2 conversations."""
        from acre_train.data.tokenizer import auto_tokenizer

        from .corpus import write_corpus

        if (self.streams / "corpus-manifest.json").is_file():
            self.log(f"corpus: {self.streams / 'corpus-manifest.json'} exists; skipped")
            return
        squad = self._need_squad()
        if not (self.streams / "squad-train.json").is_file():
            self.step_streams()
        c = self.config
        manifest = write_corpus(auto_tokenizer(c.base), squad, self.streams / "squad-train.json", self.streams,
                                tokens=c.corpus_tokens, conversations=c.corpus_conversations, lengths=c.corpus_lengths)
        s1, s2 = manifest["stage1"], manifest["stage2"]
        self.log(f"corpus: stage 1 {s1['tokens']:,} tokens in {s1['documents']} documents; stage 2 "
                 f"{s2['conversations']} conversations ({s2['distinct_question_answer']} distinct question/answer pairs)")

    def step_export(self) -> None:
        import torch

        from acre_train.base.fetch import resolve_source
        from acre_train.data.tokenizer import auto_tokenizer
        from acre_train.export import export_model
        from acre_train.export.checkpoint import load_checkpoint_model
        from acre_train.modeling import attach_acre

        base = resolve_source(self.config.base)
        tok = auto_tokenizer(base)
        for model in ("stage0", *RUNS):
            out = self.export_dir(model)
            if (out / "config.json").is_file():
                continue
            if model == "stage0":  # untrained L1: copies of the base projections
                from transformers import AutoModelForCausalLM

                acre = attach_acre(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
                source = {"stage": 0}
            elif model in self.config.adapters and not self._has_checkpoint(model):
                acre, source = self._from_adapter(model, base)
            elif not self._has_checkpoint(model):
                self.log(f"export: {model} has no checkpoint and no kept adapter (--adapter {model}=FILE); skipped")
                continue
            else:
                loaded = load_checkpoint_model(str(self.run_dir(model)))
                acre, source = loaded.model, {"checkpoint": str(loaded.checkpoint), "step": loaded.meta.get("step")}
            export_model(acre, out, tokenizer=tok, adapter_only=True, base_model=base,
                         inference=self.config.inference.inference_dict(), source=source)
            self.log(f"export: {model} -> {out}")
            del acre

    def _has_checkpoint(self, model: str) -> bool:
        from acre_train.train.checkpoint import latest_checkpoint

        run = self.run_dir(model)
        return run.is_dir() and latest_checkpoint(run) is not None

    def _from_adapter(self, model: str, base: str):
        """The ACRE model of a kept L1 weight file, with the L1 form (LoRA rank...) its recipe names."""
        from acre_train.export.checkpoint import model_from_adapter
        from acre_train.train.recipe import load_recipe

        spec = RUNS[model]
        recipe = load_recipe(Path(self.config.recipes) / f"{spec.recipe}.yaml", list(spec.overrides))
        path = self.config.adapters[model]
        acre = model_from_adapter(base, path, l1=recipe.model.l1, lora=recipe.model.lora.model_dump())
        return acre, {"adapter": str(path)}

    def eval_cells(self) -> list[tuple[int, str, str]]:
        """(length, task, model) in the order they run: ``config.cells`` if given, else every cell."""
        every = [(length, task, model) for length in self.config.lengths for task in self.config.tasks for model in MODELS]
        if not self.config.cells:
            return every
        chosen = []
        for spec in self.config.cells:
            parts = spec.split("/")
            if len(parts) not in (2, 3) or not parts[0].isdigit():
                raise ValueError(f"cell {spec!r}: expected LENGTH/TASK or LENGTH/TASK/MODEL (e.g. 4096/squad/base)")
            match = [c for c in every if str(c[0]) == parts[0] and c[1] == parts[1] and (len(parts) == 2 or c[2] == parts[2])]
            if not match:
                raise ValueError(f"cell {spec!r} is not one of the study's cells (lengths {self.config.lengths}, "
                                 f"tasks {self.config.tasks}, models {tuple(MODELS)})")
            chosen += [c for c in match if c not in chosen]
        return chosen

    def step_eval(self) -> None:
        for length, task, model in self.eval_cells():
            self._eval_cell(length, task, model)

    def _examples(self, tokenizer, length: int, task: str):
        from acre_train.eval.tasks import build_task

        return build_task(task, tokenizer, length, self.config.questions, EVAL_SEED,
                          squad_path=self.streams / "squad-heldout.json",
                          questions_per_context=self.config.questions_per_context)

    def _methods(self, length: int, task: str, model: str) -> list[str]:
        rows = [self.config.cachefocus if r == "cachefocus" else r for r in MODELS[model]]
        if "truncated" in rows:  # the budget the acre row attended at this cell (stage 0: same geometry)
            acre = json.loads((self.cell_dir(length, task, "stage0") / "summary.json").read_text())
            budget = int(round(acre["overall"]["acre"]["kv_attended"]))
            rows[rows.index("truncated")] = f"truncated:budget={budget}"
        return rows

    def _eval_cell(self, length: int, task: str, model: str) -> None:
        import torch

        from acre_train.base.fetch import resolve_source
        from acre_train.data.tokenizer import auto_tokenizer
        from acre_train.eval.harness import EvalConfig, evaluate
        from acre_train.eval.methods import parse_methods

        out = self.cell_dir(length, task, model)
        if (out / "summary.json").is_file():
            return
        methods = parse_methods(",".join(self._methods(length, task, model)))
        if model == "base":
            from transformers import AutoModelForCausalLM

            path = resolve_source(self.config.base)
            net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        else:
            from acre_train.infer.load import load_export

            net, _, _ = load_export(self.export_dir(model))
            path = resolve_source(self.config.base)
        tok = auto_tokenizer(path)
        examples = self._examples(tok, length, task)
        self.log(f"eval {length}/{task}/{model}: {len(examples)} questions, rows {[m.label() for m in methods]}")
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tic = time.time()
        evaluate(net, tok, examples, methods, config=EvalConfig(self.config.max_new_tokens[task], progress=True), out_dir=tmp)
        (tmp / "cell.json").write_text(json.dumps({"seconds": round(time.time() - tic, 1), "length": length,
                                                   "task": task, "model": model, "seed": EVAL_SEED,
                                                   "config": asdict(self.config)}, indent=2) + "\n")
        tmp.replace(out)
        del net

    def step_report(self) -> None:
        from .report import write_report

        path = write_report(self)
        self.log(f"report: {path}")
