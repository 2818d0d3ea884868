"""``acre-train recipes ls|cp``: the recipes that ship with acre-train (as torchtune's ``tune ls/cp``).

Every verb that takes a recipe also takes a packaged one by name (``acre-train train tiny_stage1``),
so a pip-installed acre-train needs no checkout; ``cp`` makes an editable copy.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    sub.add_parser("ls", help="list the packaged recipes and configs")
    p = sub.add_parser("cp", help="copy a packaged recipe or config to a file or folder you can edit")
    p.add_argument("name", help="as 'ls' prints it, e.g. tiny_stage1 or qwen2.5-0.5b/stage2 or deepspeed/zero2.json")
    p.add_argument("dest", help="a file path, or an existing folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")


def _describe(path: Path) -> str:
    """A recipe's first comment line (what it is)."""
    if path.suffix != ".yaml":
        return ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") and line.strip("# ").strip():
            return line.lstrip("# ").strip()
    return ""


def packaged_files() -> list[Path]:
    from .train.recipe import PACKAGED_RECIPES

    return sorted(p for p in PACKAGED_RECIPES.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json"))


def run(args: argparse.Namespace) -> int:
    from .train.recipe import PACKAGED_RECIPES

    if args.action == "ls":
        for path in packaged_files():
            rel = path.relative_to(PACKAGED_RECIPES).as_posix()
            name = rel[:-5] if rel.endswith(".yaml") else rel
            print(f"{name:<32} {_describe(path)}")
        return 0
    source = PACKAGED_RECIPES / args.name
    if not source.is_file():
        source = PACKAGED_RECIPES / f"{args.name}.yaml"
    if not source.is_file():
        raise FileNotFoundError(f"no packaged recipe or config {args.name!r}; see 'acre-train recipes ls'")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.overwrite:
        raise FileExistsError(f"{dest} exists; pass --overwrite to replace it")
    shutil.copyfile(source, dest)
    print(f"copied {args.name} -> {dest}")
    return 0
