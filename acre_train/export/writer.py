"""Writing inference-ready Hugging Face folders for ACRE models (full or adapter-only).

A full export holds ``config.json`` (``model_type: acre``, the base config's fields, an ``acre``
section with the inference defaults, ``auto_map``), ``model.safetensors``, the tokenizer files and the
modeling code (``hf.py`` + its relative imports), so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works offline without
acre-train. An adapter-only export replaces the weights by ``acre_adapter.safetensors`` (the L1
weights) and records ``base_model_name_or_path``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import FolderLock, atomic_dir, remove_stale
from ..modeling.adapter import acre_state_dict, is_acre_model
from ..modeling.hf import ACRE_EXPORT_FORMAT, ADAPTER_WEIGHTS, AcreConfig, wrap

EXPORT_README = """# ACRE export

Load with `AutoModelForCausalLM.from_pretrained(this_folder, trust_remote_code=True)` (plain calls
behave like the base model) or answer long-context questions with
`acre-train chat {folder} --context FILE`.
"""


def export_model(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    adapter_only: bool = False,
    base_model: str | None = None,
    inference: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
    overwrite: bool = False,
    scorer: tuple[Any, str] | None = None,
) -> Path:
    """Write ``model`` (an ACRE model from ``attach_acre``) to ``out_dir``; returns the folder.

    ``base_model``: where an adapter-only export finds its base (path or hub id; required then).
    ``inference``: default inference settings stored under ``config.acre.inference``.
    ``source``: provenance (checkpoint path, step) stored under ``config.acre.source``.
    ``scorer``: ``(QueryMap, spec)`` of a learned scorer, written to ``acre_scorer.safetensors``.
    """
    if not is_acre_model(model):
        raise ValueError("export needs an ACRE model (attach_acre); got a model without L1 parameters")
    if adapter_only and not base_model:
        raise ValueError("--adapter-only needs the base model it points to (--base-model PATH_OR_HUB_ID)")
    bad = [name for name, t in acre_state_dict(model).items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"refusing to export non-finite (NaN/inf) L1 weights: {', '.join(bad[:3])}"
                         f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}; export an earlier checkpoint")
    with FolderLock(Path(out_dir), "export"):
        return _export(model, Path(out_dir), tokenizer, adapter_only, base_model, inference, source, overwrite, scorer)


def _export(model: nn.Module, out_dir: Path, tokenizer: Any, adapter_only: bool, base_model: str | None,
            inference: dict[str, Any] | None, source: dict[str, Any] | None, overwrite: bool,
            scorer: tuple[Any, str] | None) -> Path:
    final = _check_target(out_dir, overwrite)
    # Written under a temporary name and renamed at the end: an interrupted export (kill, full disk)
    # never leaves a folder with a config.json that looks complete.
    with atomic_dir(final, f"the export {final}") as out:
        _write(model, out, final, tokenizer, adapter_only, base_model, inference, source)
        if scorer is not None:
            from ..modeling.learned_scorer import SCORER_WEIGHTS

            scorer[0].save(out / SCORER_WEIGHTS, scorer[1])
    return final


def _write(model: nn.Module, out: Path, final: Path, tokenizer: Any, adapter_only: bool, base_model: str | None,
           inference: dict[str, Any] | None, source: dict[str, Any] | None) -> None:
    section = {"format": ACRE_EXPORT_FORMAT, "inference": dict(inference or {}), "source": dict(source or {})}
    hf_model = wrap(model, acre=section)
    if adapter_only:
        from safetensors.torch import save_file
        from transformers.dynamic_module_utils import custom_object_save

        config: AcreConfig = hf_model.config
        config.adapter_only = True
        config.base_model_name_or_path = str(base_model)
        custom_object_save(hf_model, out, config=config)  # modeling files + auto_map
        config.save_pretrained(out)
        save_file({k: v.detach().contiguous().cpu() for k, v in acre_state_dict(model).items()},
                  str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    else:
        hf_model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / "README.md").write_text(EXPORT_README.format(folder=final), encoding="utf-8")


def _check_target(out: Path, overwrite: bool, plain: bool = False) -> Path:
    """``out`` may be written: absent, empty, or (with ``overwrite``) an ACRE export, or a vanilla run's
    export when ``plain``."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace it")
        ours = (out / "acre_vanilla.json").is_file() if plain else (
            (out / "config.json").is_file() and json.loads((out / "config.json").read_text()).get("model_type") == "acre")
        if not ours:
            raise FileExistsError(f"refusing to overwrite {out}: it is not an {'export of a vanilla run' if plain else 'ACRE export'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)  # left by a killed export
    return out
