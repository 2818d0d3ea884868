"""What the stage-2 training options cost per sample: refilled layout and distillation against plain.

Each arm is one forward + backward of ``LossModule`` (the module the trainer runs) on one synthetic
sample -- a random-token context, a 16-token question and a 16-token answer -- at each length, in
its own process so that its peak memory (max RSS, CPU; max allocated, CUDA) is its own::

    python benchmarks/train_step_cost.py --base base:qwen2.5-coder-0.5b-instruct --lengths 2048,4096
    python benchmarks/train_step_cost.py --tiny          # CI-sized smoke run

Arms: ``plain`` (stage 2 as the paper: the answer over L1 memory), ``distill`` (+ the frozen base as
teacher, top-64 KL), ``sim`` (the refilled layout, ``train.refill_sim``), ``sim+distill``, and
``packed4`` (the refilled layout, four question/answer segments after one context:
``data.prepare.pack_questions``), and stage 1 ``s1`` / ``s1+distill`` on the same tokens. Printed:
seconds per sample (median of ``--repeat``), ratio to ``plain`` at the same length, answer tokens
trained per second (what packing buys), and peak MiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

ARMS = ("plain", "distill", "sim", "sim+distill", "packed4", "s1", "s1+distill")


def _model(base: str | None):
    import torch

    from acre_train.modeling import attach_acre

    if base is None:
        from acre_train.tiny import tiny_model

        return attach_acre(tiny_model("qwen2", seed=0, vocab_size=1024, eos_token_id=0)).train()
    from transformers import AutoModelForCausalLM

    from acre_train.base.fetch import resolve_source

    model = AutoModelForCausalLM.from_pretrained(resolve_source(base), dtype=torch.float32, attn_implementation="sdpa")
    return attach_acre(model, lora={"rank": 16, "alpha": 32, "dropout": 0.0}).train()


def _row(length: int, vocab: int, geometry: tuple[int, int, int], questions: int = 1):
    import numpy as np

    from acre_train.modeling import interleave

    rng = np.random.default_rng(0)
    raw = rng.integers(10, vocab - 10, length).tolist()
    labels, question, evidence, owner = [-100] * length, [], [], []
    for j in range(questions):  # 16-token question, 16-token answer per segment
        q, a = rng.integers(10, vocab - 10, 16).tolist(), rng.integers(10, vocab - 10, 16).tolist()
        question += [len(raw), len(raw) + 16]
        raw, labels = raw + q + a, labels + [-100] * 16 + a
        evidence += [length * (j + 1) // (questions + 2), length * (j + 1) // (questions + 2) + 20]
        owner.append(j)
    first, stride, interval = geometry
    plan = interleave(raw, first_chunk=first, stride=stride, intervals=interval, raw_labels=labels)
    return {**plan.as_dict(), "evidence": evidence, "evidence_question": owner, "question": question, "sample_index": 0}


def run_arm(arm: str, length: int, base: str | None, repeat: int, geometry: tuple[int, int, int]) -> dict:
    import torch

    from acre_train.modeling.scorer_spec import ScorerSettings
    from acre_train.modeling.batch import pad_batch
    from acre_train.train.batching import PLAN_COLUMNS, Collator
    from acre_train.train.model import LossModule
    from acre_train.train.refill_sim import SimSettings

    model = _model(base)
    row = _row(length, model.config.vocab_size, geometry, questions=4 if arm == "packed4" else 1)
    first, stride, interval = geometry
    sim = SimSettings(first, stride, interval, working_window=32768, max_refill=6 * interval,
                      scorer=ScorerSettings.parse("l2:layers=-1,heads=max"), force_evidence=0.5)
    distill = {"weight": 0.5, "temperature": 1.0, "top_k": 64, "stage": 1 if arm.startswith("s1") else 2}
    uses_sim = arm.startswith("sim") or arm.startswith("packed")
    module = LossModule(model, sim=sim if uses_sim else None,
                        distill=distill if arm.endswith("distill") else None)
    if uses_sim:
        batch = Collator(sim=sim)([row])
    else:
        if arm.startswith("s1"):  # stage 1: every raw token labelled
            from acre_train.modeling import interleave
            import numpy as np

            raw = np.asarray(row["input_ids"])[~np.asarray(row["is_l1"])]
            row = interleave(raw, first_chunk=first, stride=stride, intervals=interval).as_dict()
        batch = pad_batch([{k: row[k] for k in PLAN_COLUMNS}])
    times = []
    for _ in range(repeat):
        tic = time.perf_counter()
        loss, _, _ = module(**dict(batch))
        loss.backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - tic)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    answers = int((batch["labels"] != -100).sum())
    return {"arm": arm, "length": length, "seconds": statistics.median(times), "peak_mib": peak,
            "answer_tokens_per_s": answers / statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default=None, help="a base (path or base:NAME); default: a tiny random Qwen2")
    parser.add_argument("--tiny", action="store_true", help="tiny model, length 96 (CI smoke: every arm once)")
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    geometry = (32, 16, 4) if args.tiny or args.base is None else (1024, 512, 32)
    if args.child:
        arm, length = args.child.split("@")
        print(json.dumps(run_arm(arm, int(length), None if args.tiny else args.base, args.repeat, geometry)))
        return
    lengths = [96] if args.tiny else [int(x) for x in args.lengths.split(",")]
    rows = []
    for length in lengths:
        for arm in args.arms.split(","):
            cmd = [sys.executable, __file__, "--child", f"{arm}@{length}", "--repeat", str(args.repeat)]
            cmd += ["--tiny"] if args.tiny else (["--base", args.base] if args.base else [])
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{arm}@{length} failed:\n{out.stderr[-2000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'length':>7} {'arm':<12} {'s/sample':>9} {'x plain':>8} {'answer tok/s':>13} {'peak MiB':>9}")
    for row in rows:
        plain = next(r for r in rows if r["length"] == row["length"] and r["arm"] == ("s1" if row["arm"].startswith("s1") else "plain"))
        print(f"{row['length']:>7} {row['arm']:<12} {row['seconds']:>9.2f} {row['seconds'] / plain['seconds']:>8.2f} "
              f"{row['answer_tokens_per_s']:>13.1f} {row['peak_mib']:>9.0f}")


if __name__ == "__main__":
    main()
