"""The miniature study driver: tokenizer -> streams -> base -> ACRE stage 1/2 + ablations -> comparison.

Every step writes its outputs under ``root`` and is skipped when they already exist (so an
interrupted study continues where it stopped); the wall time of each step run is recorded in
``root/timings.json``. Training steps run the toolkit's own command, ``acre-train train
studies/mini/recipes/<step>.yaml k=v ...``, in a subprocess (optionally under ``nice``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
RECIPES = Path(__file__).resolve().parent / "recipes"  # the study's own recipes (not installed)
STEPS = ("tokenizer", "streams", "base", "base2", "export-base", "stage1", "stage2", "vanilla-sft", "eval", "report")
# Training steps: their run folder under runs/ and the stream (= prepared data folder) they train on.
RUNS = {"base": "base", "base2": "base2", "stage1": "acre-stage1", "stage2": "acre-stage2", "vanilla-sft": "vanilla-sft"}
STREAM_OF = {"base": "base", "base2": "base2", "stage1": "stage1", "stage2": "stage2", "vanilla-sft": "stage2"}


@dataclass
class StudyConfig:
    """Everything that sizes the study; ``full()`` is the real run, ``smoke()`` the CI run."""

    name: str = "full"
    vocab_size: int = 2048
    model: dict[str, int] = field(default_factory=dict)  # tiny_config overrides ({} = the recipe's)
    window: int = 1024
    long_window: int = 3072
    base_docs: int = 24000  # phase-1 drills (one epoch of 1,500 steps x 16)
    base2_docs: int = 12800  # phase-2 needle-task conversations (800 steps x 16, in curriculum order)
    stage1_docs: int = 200
    stage2_samples: int = 480
    stage2_max_context: int = 2600
    steps: dict[str, int] = field(default_factory=lambda: {"base": 1500, "base2": 800, "stage1": 60, "stage2": 120,
                                                               "vanilla-sft": 120})
    batch: dict[str, int] = field(default_factory=dict)  # global_batch_size overrides ({} = the recipe's)
    first_chunk: int = 128
    stride: int = 128
    interval: int = 32
    max_refill: int = 96  # 3 spans of 32: keeps the 960-token budget under 25 % (128 gave 27 %)
    working_window: int = 1024
    eval_lengths: tuple[int, ...] = (960, 4096, 8192, 16384)
    eval_tasks: tuple[str, ...] = ("niah_single", "niah_multikey", "vt", "squad")
    eval_examples: int = 5  # per task and length (CPU time: a 16K full-attention answer takes ~10 s here)
    squad_max_length: int = 4096  # SQuAD rows only up to this context length (CPU time)
    max_new_tokens: int = 24
    baselines: tuple[str, ...] = ("full", "truncated", "cachefocus:n=1", "infoflow")  # n=1: a 4-layer model
    selfcheck_task: str = "niah_multikey"
    selfcheck_length: int = 512
    selfcheck_examples: int = 20

    @classmethod
    def full(cls) -> "StudyConfig":
        return cls()

    @classmethod
    def smoke(cls) -> "StudyConfig":
        return cls(
            name="smoke", vocab_size=512,
            model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=640),
            window=384, long_window=640, base_docs=16, base2_docs=16, stage1_docs=6, stage2_samples=8, stage2_max_context=500,
            steps={"base": 3, "base2": 2, "stage1": 2, "stage2": 2, "vanilla-sft": 2},
            batch={"base": 4, "base2": 4, "stage1": 2, "stage2": 2, "vanilla-sft": 2},
            first_chunk=64, stride=64, interval=16, max_refill=32, working_window=384,
            eval_lengths=(300, 900), eval_tasks=("niah_single", "squad"), eval_examples=1, max_new_tokens=4,
            selfcheck_length=160, selfcheck_examples=2,
        )


class Study:
    def __init__(self, root: str | Path, config: StudyConfig, *, nice: int = 0, log: Callable[[str], None] = print):
        self.root = Path(root).resolve()
        self.config = config
        self.nice = nice
        self.log = log
        self.root.mkdir(parents=True, exist_ok=True)
        self.timings_file = self.root / "timings.json"
        self.redo = False  # the step being run replaces earlier outputs (forced, or an earlier step re-ran)

    # ------------------------------------------------------------------------------ paths

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    def stream(self, name: str) -> Path:
        return self.root / "streams" / f"{name}.jsonl"

    def run_dir(self, step: str) -> Path:
        return self.root / "runs" / RUNS[step]

    @property
    def base_dir(self) -> Path:
        return self.root / "base_model"

    @property
    def phase1_dir(self) -> Path:
        return self.root / "base_phase1"

    # ------------------------------------------------------------------------------ running

    def timings(self) -> dict[str, Any]:
        return json.loads(self.timings_file.read_text()) if self.timings_file.is_file() else {}

    def run(self, steps: tuple[str, ...] = STEPS, force: bool = False) -> dict[str, Any]:
        """Run ``steps`` in study order. A finished step is skipped unless ``force``d or an earlier step
        re-ran in this call (its outputs were made from what that step replaced); a step that re-runs
        first moves its old outputs aside (``<name>.replaced-<time>``), so nothing is lost and a
        training step does not "resume" the finished run it should replace."""
        unknown = [s for s in steps if s not in STEPS]
        if unknown:
            raise ValueError(f"unknown step {unknown[0]!r}; steps: {', '.join(STEPS)}")
        (self.root / "study_config.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        upstream_ran = False
        for step in sorted(steps, key=STEPS.index):
            self.redo = force or upstream_ran
            if not self.redo and self.done(step):
                self.log(f"[mini] {step}: already done, skipped")
                continue
            if self.redo:
                self.set_aside(step)
            self.log(f"[mini] {step}: start")
            began = time.time()
            getattr(self, "step_" + step.replace("-", "_"))()
            upstream_ran = True
            elapsed = time.time() - began
            timings = self.timings()
            timings[step] = round(elapsed, 1)
            self.timings_file.write_text(json.dumps(timings, indent=2) + "\n")
            self.log(f"[mini] {step}: done in {elapsed:.1f}s")
        return self.timings()

    def set_aside(self, step: str) -> None:
        """Move a step's previous outputs to ``<name>.replaced-<time>`` before it runs again."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        old: list[Path] = []
        if step == "streams":
            old = [self.root / "streams"]
        elif step in RUNS:
            old = [self.run_dir(step)]
        elif step == "export-base":
            old = [self.base_dir]
        elif step == "eval":
            old = [self.root / "eval"]
        for path in (p for p in old if p.exists()):
            target, n = path.with_name(f"{path.name}.replaced-{stamp}"), 1
            while target.exists():
                n += 1
                target = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
            path.rename(target)
            self.log(f"  previous {path.name} kept as {target.name}")

    def done(self, step: str) -> bool:
        from acre_train.train.checkpoint import latest_checkpoint, read_meta

        if step == "tokenizer":
            return (self.tokenizer_dir / "tokenizer.json").is_file()
        if step == "streams":
            return all(self.stream(n).is_file() for n in ("base", "base2", "stage1", "stage2"))
        if step in RUNS:
            ckpt = latest_checkpoint(self.run_dir(step))
            if ckpt is None:
                return False
            return int(read_meta(ckpt).get("step", -1)) >= self.config.steps[step]
        if step == "export-base":
            return (self.base_dir / "mini_eval.json").is_file()
        if step == "eval":
            return (self.root / "eval" / "results.json").is_file()
        if step == "report":
            return (self.root / "report.md").is_file()
        return False

    # ------------------------------------------------------------------------------ steps

    def step_tokenizer(self) -> None:
        from .data import train_tokenizer

        tok = train_tokenizer(self.tokenizer_dir, self.config.vocab_size)
        self.log(f"  tokenizer: {len(tok)} tokens -> {self.tokenizer_dir}")

    def eval_questions(self, tokenizer) -> set[str]:
        """Questions of every SQuAD evaluation set (excluded from training streams)."""
        from acre_train.eval.tasks import build_task
        from .data import EVAL_SEED

        if "squad" not in self.config.eval_tasks:
            return set()
        return {e.question for n in self.config.eval_lengths
                for e in build_task("squad", tokenizer, n, self.config.eval_examples, EVAL_SEED)}

    def step_streams(self) -> None:
        from acre_train.data.tokenizer import auto_tokenizer

        from .data import (StreamSettings, drill_conversations, stage1_documents, stage2_conversations,
                           task_conversations, write_jsonl)

        c = self.config
        tok = auto_tokenizer(str(self.tokenizer_dir))
        s = StreamSettings(window=c.window, long_window=c.long_window, base_docs=c.base_docs, base2_docs=c.base2_docs,
                           stage1_docs=c.stage1_docs, stage2_samples=c.stage2_samples,
                           stage2_max_context=c.stage2_max_context)
        exclude = self.eval_questions(tok)
        streams = {"base": lambda: drill_conversations(s), "base2": lambda: task_conversations(tok, s),
                   "stage1": lambda: stage1_documents(tok, s, exclude), "stage2": lambda: stage2_conversations(tok, s, exclude)}
        for name, records in streams.items():
            if self.stream(name).is_file():
                continue
            n = write_jsonl(records(), self.stream(name))
            self.log(f"  stream {name}: {n} records -> {self.stream(name)}")

    def _overrides(self, step: str) -> list[str]:
        c = self.config
        data = self.root / "data" / STREAM_OF[step]
        stream = self.stream(STREAM_OF[step])
        out = [f"output_root={self.root / 'runs'}", f"data.path={data}", f"data.prepare.inputs=[{stream}]",
               f"data.prepare.tokenizer={self.tokenizer_dir}", f"train.max_steps={c.steps[step]}"]
        if self.redo:  # the stream may have changed since data.path was prepared from it
            out.append("data.prepare.overwrite=true")
        if step in c.batch:  # (smoke sizes) one sample per micro-batch, so any global batch splits
            out += [f"train.global_batch_size={c.batch[step]}", "train.micro_batch_size=1"]
        if step == "base":
            out += [f"model.tiny_config.{k}={v}" for k, v in c.model.items()]
        if step == "base2":
            out.append(f"model.source={self.phase1_dir}")
        if step in ("base", "base2"):  # conversations up to the window
            out.append(f"data.prepare.max_length={c.window}")
        else:
            out += [f"model.source={self.base_dir}", f"data.prepare.first_chunk={c.first_chunk}",
                    f"data.prepare.stride={c.stride}", f"data.prepare.intervals=[{c.interval}]"]
        if step == "stage1":
            out += [f"data.prepare.min_length={c.long_window}", f"data.prepare.max_length={c.long_window}"]
        if step == "stage2":
            out.append(f"model.init_from={self.run_dir('stage1')}")
        if step in ("stage2", "vanilla-sft"):
            out.append(f"data.prepare.max_length={c.stage2_max_context + 400}")
        return out

    def train(self, step: str) -> None:
        recipe = RECIPES / {"base": "base.yaml", "base2": "base_phase2.yaml", "stage1": "stage1.yaml", "stage2": "stage2.yaml",
                            "vanilla-sft": "vanilla_sft.yaml"}[step]
        cmd = [sys.executable, "-m", "acre_train.cli", "train", str(recipe), *self._overrides(step),
               "checkpoint.resume_from_checkpoint=latest"]  # a fresh start when the run has no checkpoint
        if self.nice:
            cmd = ["nice", "-n", str(self.nice), *cmd]
        self.log("  $ " + " ".join(shlex.quote(str(x)) for x in cmd))
        with open(self.root / f"{step}.log", "a", encoding="utf-8") as logf:
            rc = subprocess.call(cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT,
                                 env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if rc != 0:
            tail = (self.root / f"{step}.log").read_text(encoding="utf-8")[-3000:]
            raise RuntimeError(f"step {step} failed (exit {rc}); log tail:\n{tail}")

    def step_base(self) -> None:
        self.train("base")

    def export_phase(self, config_dir: Path, run: str, out: Path) -> None:
        """A pretraining phase's weights as a HF folder (+ tokenizer and self-check)."""
        from acre_train.data.tokenizer import auto_tokenizer

        model = load_full_weights(config_dir, self.run_dir(run))
        model.save_pretrained(str(out))
        auto_tokenizer(str(self.tokenizer_dir)).save_pretrained(str(out))
        (out / "mini_eval.json").unlink(missing_ok=True)
        check = self_check(out, self.config)
        (out / "mini_eval.json").write_text(json.dumps(check, indent=2) + "\n")
        self.log(f"  {out.name}: self-check {check['task']}@{check['context_tokens']}: {check['score']:.3f} "
                 f"over {check['examples']} examples")

    def step_base2(self) -> None:
        """Phase 2 of base pretraining, continuing from the phase-1 weights (exported as a HF folder)."""
        self.export_phase(self.run_dir("base") / "base_model", "base", self.phase1_dir)
        self.train("base2")

    def step_stage1(self) -> None:
        self.train("stage1")

    def step_stage2(self) -> None:
        self.train("stage2")

    def step_vanilla_sft(self) -> None:
        self.train("vanilla-sft")

    def step_export_base(self) -> None:
        """The trained base as a plain HF folder (safetensors + config + tokenizer) + its self-check."""
        self.export_phase(self.phase1_dir, "base2", self.base_dir)

    # ------------------------------------------------------------------------------ evaluation

    def models(self):
        """(label prefix, model loader) of every evaluated model."""
        from transformers import AutoModelForCausalLM

        from acre_train.export.checkpoint import load_checkpoint_model

        return {
            "base": lambda: AutoModelForCausalLM.from_pretrained(str(self.base_dir)).eval(),
            "acre": lambda: load_checkpoint_model(self.run_dir("stage2")).model,
            "acre-s1": lambda: load_checkpoint_model(self.run_dir("stage1")).model,
            "vanilla-sft": lambda: load_full_weights(self.base_dir, self.run_dir("vanilla-sft")),
        }

    def acre_options(self, refill: bool = True) -> dict[str, Any]:
        c = self.config
        return dict(first_chunk=c.first_chunk, stride=c.stride, interval=c.interval,
                    max_refill=c.max_refill if refill else 0, working_window=c.working_window)

    def step_eval(self) -> None:
        from acre_train.data.tokenizer import auto_tokenizer

        from acre_train.eval.harness import EvalConfig, evaluate, summarize
        from acre_train.eval.methods import METHODS, parse_method
        from acre_train.eval.tasks import build_task
        from .data import EVAL_SEED

        c = self.config
        tok = auto_tokenizer(str(self.tokenizer_dir))
        loaders = self.models()
        cfg = EvalConfig(max_new_tokens=c.max_new_tokens, progress=False)
        out_dir = self.root / "eval"
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out_dir / "results.partial.json"
        results: dict[str, Any] = {"lengths": {}, "seed": EVAL_SEED, "config": asdict(c)}
        if partial.is_file():  # an interrupted evaluation continues with the next length
            old = json.loads(partial.read_text())
            if old.get("config") == json.loads(json.dumps(asdict(c))):
                results = old
        if not results["lengths"]:
            (out_dir / "predictions.jsonl").unlink(missing_ok=True)
        cache: dict[str, Any] = {}

        def model(name):
            if name not in cache:
                cache.clear()
                cache[name] = loaders[name]()
            return cache[name]

        plan: list[tuple[str, str, Any]] = []  # (row label, model, method factory)
        plan.append(("acre", "acre", lambda: METHODS["acre"](**self.acre_options())))
        plan.append(("acre-l1", "acre", lambda: METHODS["acre-l1"](**self.acre_options(False))))
        plan.append(("acre (stage 1 only)", "acre-s1", lambda: METHODS["acre"](**self.acre_options())))
        # `full` means full attention over the whole prompt at every length (the harness's `full`
        # middle-cuts prompts beyond max_position_embeddings; that is the "truncated (base window)" row).
        full_spec = "full:max_length=1000000"
        plan.append(("vanilla-sft (full)", "vanilla-sft", lambda: parse_method(full_spec)))
        for length in c.eval_lengths:
            if str(length) in results["lengths"]:
                self.log(f"  eval @{length}: done earlier, skipped")
                continue
            tasks = [t for t in c.eval_tasks if t != "squad" or length <= c.squad_max_length]
            examples = [e for t in tasks for e in build_task(t, tok, length, c.eval_examples, EVAL_SEED)]
            rows_here: list[dict[str, Any]] = []
            began = time.time()
            for label, model_name, factory in plan:
                rep = evaluate(model(model_name), tok, examples, [factory()], config=cfg)
                for r in rep.rows:
                    r["method"] = label
                rows_here += rep.rows
            # Baselines on the base model; `truncated` gets the budget ACRE attended at this length.
            acre_kv = sum(r["kv_attended"] for r in rows_here if r["method"] == "acre") / max(
                1, sum(1 for r in rows_here if r["method"] == "acre"))
            shortest = min(r["prompt_tokens"] for r in rows_here)  # truncation must cut something in every prompt
            specs = []  # (row label, method spec)
            for b in c.baselines:
                if b == "truncated" and acre_kv < shortest:
                    specs.append(("truncated (ACRE budget)", f"truncated:budget={int(round(acre_kv))}"))
                elif b == "truncated":
                    continue  # ACRE attended the whole prompt here: nothing to truncate
                elif b == "full":
                    specs.append(("full", full_spec))
                else:
                    specs.append((b, b))
            if length > c.window and "truncated" in c.baselines and shortest > c.window:
                specs.append(("truncated (base window)", f"truncated:budget={c.window}"))
            for label, spec in specs:
                rep = evaluate(model("base"), tok, examples, [parse_method(spec)], config=cfg)
                for r in rep.rows:
                    r["method_spec"], r["method"] = r["method"], label
                rows_here += rep.rows
            for r in rows_here:
                r["context_length"] = length
            labels = list(dict.fromkeys(r["method"] for r in rows_here))
            results["lengths"][str(length)] = {"summary": summarize(rows_here, labels),
                                               "refill": refill_summary(rows_here), "shortest_prompt": shortest,
                                               "seconds": round(time.time() - began, 1)}
            self.log(f"  eval @{length}: {len(rows_here)} answers in {time.time() - began:.0f}s")
            with open(out_dir / "predictions.jsonl", "a", encoding="utf-8") as f:
                for r in rows_here:
                    f.write(json.dumps({k: v for k, v in r.items() if k != "first_logits"}, default=str) + "\n")
            partial.write_text(json.dumps(results, indent=2, default=str) + "\n")
        (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")

    def step_report(self) -> None:
        from .report import write_report

        write_report(self.root)


def refill_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ACRE row: mean refill recall of the evidence and mean visible share of the context (≈ chance)."""
    out: dict[str, Any] = {}
    for label in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == label and r.get("refill_recall") is not None]
        if mine:
            out[label] = {"n": len(mine), "refill_recall": 100 * sum(r["refill_recall"] for r in mine) / len(mine),
                          "visible_share": 100 * sum(r["refill_visible_share"] for r in mine) / len(mine)}
    return out


def load_full_weights(config_dir: Path, run_dir: Path):
    """A model from ``config_dir`` with every weight replaced by the newest checkpoint of ``run_dir``."""
    from transformers import AutoModelForCausalLM

    from acre_train.train.checkpoint import find_weights_checkpoint, load_trainable

    model = AutoModelForCausalLM.from_pretrained(str(config_dir))
    state = load_trainable(find_weights_checkpoint(Path(run_dir)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or missing:
        raise ValueError(f"{run_dir}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def self_check(model_dir: str | Path, config: StudyConfig | None = None, *, task: str | None = None,
               context_tokens: int | None = None, examples: int | None = None) -> dict[str, Any]:
    """The base model's accuracy on its own retrieval task (full attention, evaluation seed + 1)."""
    from transformers import AutoModelForCausalLM

    from acre_train.data.tokenizer import auto_tokenizer

    from acre_train.eval.harness import EvalConfig, evaluate
    from acre_train.eval.methods import parse_method
    from acre_train.eval.tasks import build_task
    from .data import EVAL_SEED
    from .diagnostics import answer_nll, drill_accuracy, needle_accuracy

    config = config or StudyConfig()
    task = task or config.selfcheck_task
    context_tokens = context_tokens or config.selfcheck_length
    examples = examples or config.selfcheck_examples
    tok = auto_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    exs = build_task(task, tok, context_tokens, examples, EVAL_SEED + 1)
    rep = evaluate(model, tok, exs, [parse_method("full")], config=EvalConfig(max_new_tokens=16, progress=False))
    score = sum(r["score"] for r in rep.rows) / len(rep.rows)
    nll = answer_nll(model, tok, exs)
    # The drills the base was pretrained on (no filler), by number of facts: what it can look up.
    drills = {str(f): drill_accuracy(model, tok, f) for f in (1, 2, 4)}
    # A lone needle in reference text at growing lengths: where the lookup and the copy give out.
    needles = [needle_accuracy(model, tok, "niah_single", n, examples) for n in (128, 256, 512)
               if n <= context_tokens]
    return {"task": task, "context_tokens": context_tokens, "examples": examples, "seed": EVAL_SEED + 1,
            "method": "full", "metric": exs[0].metric, "score": score,
            "answer_nll_per_token": round(nll["nll_per_token"], 4), "digit_chance_nll": round(nll["digit_chance"], 4),
            "drills": drills, "needles": needles}
