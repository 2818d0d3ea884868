"""``acre-train export RUN_OR_CHECKPOINT OUT_DIR``: an inference-ready Hugging Face folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..modeling.geometry import WindowGeometry

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a training run directory (its newest checkpoint) or a checkpoint-<step> folder")
    parser.add_argument("out_dir", help="the export folder to write")
    parser.add_argument("--adapter-only", action="store_true",
                        help="write only the L1 weights + a pointer to the base model (small, for sharing)")
    parser.add_argument("--base-model", default=None,
                        help="adapter-only: the base model path or hub id to point at (default: the run's base)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer to include: 'tiny', a path or hub id "
                        "(default: the run's data.prepare.tokenizer, else the base model's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the written weights (default: the base model's)")
    paper = WindowGeometry()
    for name, symbol, default in (
            ("first-chunk", "W0", "the run's data.prepare.first_chunk"), ("stride", "S", "the run's data.prepare.stride"),
            ("interval", "l", "16 if the run drew it, else the middle of its intervals"),
            ("working-window", "W", f"{paper.working_window}, the paper's"), ("max-refill", "eta", f"{paper.max_refill}, the paper's")):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"default inference {symbol} stored in the export (default: {default})")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing ACRE export in OUT_DIR")


def run(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import load_checkpoint_model, load_tokenizer
    from .writer import export_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    loaded = load_checkpoint_model(args.source, dtype=dtype)
    tokenizer = load_tokenizer(args.tokenizer or loaded.tokenizer_spec, loaded.base_pointer)
    if tokenizer is None:
        print("warning: no tokenizer found; the export holds none (pass --tokenizer)")
    overrides = {key: getattr(args, key) for key in ("first_chunk", "stride", "interval", "working_window", "max_refill")}
    geometry = WindowGeometry.from_mapping(loaded.inference, ignore=("scorer", "neighbors"))
    inference = geometry.with_overrides(overrides).inference_dict()
    # The refill a refill-simulated run trained with (scorer, neighbours) rides along with its geometry.
    inference.update({k: loaded.inference[k] for k in ("scorer", "neighbors") if k in loaded.inference})
    source = {"checkpoint": str(loaded.checkpoint.resolve()), "step": loaded.meta.get("step"),
              "weights_from": loaded.weights_from, "base_model": loaded.meta.get("base_model")}
    scorer = None
    if loaded.scorer_state:
        from ..infer.learned_scorer import QueryMap

        scorer = (QueryMap.from_state(loaded.scorer_state), loaded.scorer_spec)
        inference["scorer"] = loaded.scorer_spec  # the learned scorer ranks by default; calibrate may choose
    out = export_model(loaded.model, args.out_dir, tokenizer=tokenizer, adapter_only=args.adapter_only,
                       base_model=args.base_model or loaded.base_pointer, inference=inference, source=source,
                       overwrite=args.overwrite, scorer=scorer)
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    form = "adapter-only" if args.adapter_only else "full"
    print(f"exported {loaded.checkpoint} ({loaded.weights_from}) -> {out} [{form}, {size / 2**20:.1f} MiB]")
    print(f"inference defaults: {json.dumps(inference)}")
    print(f"load: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0
