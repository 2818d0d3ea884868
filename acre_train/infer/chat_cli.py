"""``acre-train chat``: see ``acre_train/infer/cli.py``."""

from __future__ import annotations

import argparse

from .cli import add_chat_arguments, run_chat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_chat_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_chat(args)
