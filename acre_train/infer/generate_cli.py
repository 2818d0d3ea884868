"""``acre-train generate``: see ``acre_train/infer/cli.py``."""

from __future__ import annotations

import argparse

from .cli import add_generate_arguments, run_generate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generate_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_generate(args)
