"""``acre-train export RUN_OR_CHECKPOINT OUT_DIR``: an inference-ready Hugging Face folder."""

from __future__ import annotations

import argparse

from ..modeling.geometry import INFERENCE_KEYS, WindowGeometry, add_geometry_flags

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
    add_geometry_flags(parser.add_argument_group("inference defaults stored in the export"), INFERENCE_KEYS, default_help={
        "first_chunk": "what the run trained with", "stride": "what the run trained with",
        "interval": "16 if the run drew it, else the middle of its intervals",
        "working_window": f"{paper.working_window}, the paper's", "max_refill": f"{paper.max_refill}, the paper's"})
    parser.add_argument("--overwrite", action="store_true", help="replace an existing ACRE export in OUT_DIR")


def run(args: argparse.Namespace) -> int:
    from . import export_run

    overrides = {key: getattr(args, key) for key in ("first_chunk", "stride", "interval", "working_window", "max_refill")}
    out = export_run(args.source, args.out_dir, adapter_only=args.adapter_only, base_model=args.base_model,
                     tokenizer=args.tokenizer, dtype=args.dtype, geometry=overrides, overwrite=args.overwrite)
    print(f"load: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0
