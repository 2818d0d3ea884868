"""``acre-train env``: the facts a bug report needs, in one screen."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _version(name: str) -> str:
    try:
        return getattr(importlib.import_module(name), "__version__", "installed")
    except Exception as exc:  # an optional package failing to import is itself a fact to report
        return f"not available ({type(exc).__name__})"


def collect() -> dict[str, str]:
    import torch

    facts = {
        "acre-train": _version("acre_train"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "deepspeed": _version("deepspeed"),
        "accelerate": _version("accelerate"),
        "peft": _version("peft"),
        "datasets": _version("datasets"),
        "liger-kernel": _version("liger_kernel"),
        "cuda available": str(torch.cuda.is_available()),
        "torch cuda build": str(torch.version.cuda),
        "cpu threads": str(torch.get_num_threads()),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            facts[f"gpu {i}"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
        facts["bf16 supported"] = str(torch.cuda.is_bf16_supported())
    return facts


def run(args: argparse.Namespace) -> int:
    del args
    facts = collect()
    width = max(map(len, facts))
    for key, value in facts.items():
        print(f"{key:<{width}}  {value}")
    return 0
