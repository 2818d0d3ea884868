"""A training run (or one of its checkpoints) -> an export, as ``acre-train export`` makes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..modeling.selection import SELECTION_KEYS
from ..modeling.geometry import WindowGeometry


def export_run(source: str | Path, out_dir: str | Path, *, adapter_only: bool = False, base_model: str | None = None,
               tokenizer: str | None = None, dtype: str | None = None, geometry: dict[str, int | None] | None = None,
               overwrite: bool = False, log: Callable[[str], object] = print) -> Path:
    """Export the newest checkpoint of run ``source`` (or the checkpoint folder itself) to ``out_dir``.

    ``geometry`` overrides the stored inference defaults (``first_chunk``, ``stride``, ``interval``,
    ``working_window``, ``max_refill``; ``None`` keeps what the run trained with). A run trained in the
    refilled layout also stores the refill (scorer, neighbours) it trained with; a learned scorer rides
    along and ranks by default.

    >>> export_run("checkpoints/my-run", "checkpoints/my-run-export", adapter_only=True)  # doctest: +SKIP
    """
    import torch

    from ..train.checkpoint import find_weights_checkpoint, read_meta
    from .checkpoint import load_checkpoint_model, load_tokenizer
    from .writer import export_model

    if read_meta(find_weights_checkpoint(Path(source))).get("mode") == "vanilla":
        return export_vanilla_run(source, out_dir, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite, log=log)
    loaded = load_checkpoint_model(str(source), dtype=getattr(torch, dtype) if dtype else None)
    tok = load_tokenizer(tokenizer or loaded.tokenizer_spec, loaded.base_pointer)
    if tok is None:
        log("warning: no tokenizer found; the export holds none (pass --tokenizer)")
    stored = WindowGeometry.from_mapping(loaded.inference, ignore=SELECTION_KEYS)
    inference = stored.with_overrides(geometry or {}).inference_dict()
    # The refill a refill-simulated run trained with (scorer, selection) rides along with its geometry.
    inference.update({k: loaded.inference[k] for k in SELECTION_KEYS if k in loaded.inference})
    record = {"checkpoint": str(loaded.checkpoint.resolve()), "step": loaded.meta.get("step"),
              "weights_from": loaded.weights_from, "base_model": loaded.meta.get("base_model")}
    scorer = None
    if loaded.scorer_state:
        from ..modeling.learned_scorer import QueryMap

        scorer = (QueryMap.from_state(loaded.scorer_state), loaded.scorer_spec)
        inference["scorer"] = loaded.scorer_spec  # the learned scorer ranks by default; calibrate may choose
    out = export_model(loaded.model, out_dir, tokenizer=tok, adapter_only=adapter_only,
                       base_model=base_model or loaded.base_pointer, inference=inference, source=record,
                       overwrite=overwrite, scorer=scorer)
    size = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    form = "adapter-only" if adapter_only else "full"
    log(f"exported {loaded.checkpoint} ({loaded.weights_from}) -> {out} [{form}, {size / 2**20:.1f} MiB]")
    log(f"inference defaults: {json.dumps(inference)}")
    return Path(out)


def export_vanilla_run(source: str | Path, out_dir: str | Path, *, tokenizer: str | None = None, dtype: str | None = None,
                       overwrite: bool = False, log: Callable[[str], object] = print) -> Path:
    """A ``mode: vanilla`` run -> a plain Hugging Face model folder (its LoRA merged), which every verb and the
    ``full`` eval row load like any base: the SFT-vanilla control of a comparison."""
    import torch

    from ..files import atomic_dir
    from .checkpoint import _data_tokenizer, load_tokenizer, load_vanilla_model
    from .writer import _check_target

    model, checkpoint, recipe, pointer = load_vanilla_model(source, dtype=getattr(torch, dtype) if dtype else None)
    final = _check_target(Path(out_dir), overwrite, plain=True)
    prepare = ((recipe.get("data") or {}).get("prepare") or {})
    tok = load_tokenizer(tokenizer or prepare.get("tokenizer") or _data_tokenizer(recipe), pointer)
    with atomic_dir(final, f"the export {final}") as out:
        model.save_pretrained(out)
        if tok is not None:
            tok.save_pretrained(out)
        (out / "acre_vanilla.json").write_text(json.dumps(
            {"checkpoint": str(checkpoint.resolve()), "base_model": pointer,
             "trained": (recipe.get("model") or {}).get("vanilla", "full")}, indent=2) + "\n", encoding="utf-8")
    log(f"exported {checkpoint} (mode: vanilla) -> {final} [a plain model folder]")
    return final
