"""Loading an ACRE export for inference (our own classes: no ``trust_remote_code`` needed here)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..files import DamagedFileError
from ..modeling.export_format import NotAnAcreExport, check_export_dir
from ..modeling.learned_scorer import SCORER_WEIGHTS, QueryMap, attach_query_map
from .placement import Placement


def load_export(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                placement: Placement | None = None):
    """``(model, tokenizer or None, config dict)`` of an export, model in eval mode on ``device``, or
    spread by ``placement`` (a device map: GPUs, CPU, disk) when one is given."""
    from ..modeling.hf import AcreConfig, AcreForCausalLM

    data = check_export_dir(path)
    check_layer_count(path, data)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if placement is not None and placement.device_map:
        config = AcreConfig.from_pretrained(str(path))
        if not config.adapter_only:  # transformers places the weights as it reads them
            kwargs.update(placement.kwargs(lambda: AcreForCausalLM(config), dtype))
    try:
        model = AcreForCausalLM.from_pretrained(str(path), **kwargs)
    except Exception as exc:
        if not _damaged_weights(exc):
            raise
        raise DamagedFileError(f"{path}: its weights cannot be read ({str(exc).splitlines()[0]}); the export is "
                               "damaged or was copied in part: export it again") from exc
    model = _place(model, placement, dtype, device).eval()
    learned = Path(path) / SCORER_WEIGHTS
    if learned.is_file():
        attach_query_map(model, QueryMap.load(learned))
    tokenizer = None
    if any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        from transformers.utils import logging as hf_logging

        from ..data.tokenizer import auto_tokenizer

        # The tokenizer needs none of the custom code; without this flag transformers would ask
        # interactively (config.json has an auto_map). Its "model of type acre" notice is noise here.
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            tokenizer = auto_tokenizer(str(path), trust_remote_code=False)
        finally:
            hf_logging.set_verbosity(level)
    return model, tokenizer, data


def _damaged_weights(exc: BaseException) -> bool:
    """Is ``exc`` safetensors (or torch) failing to read a weights file, rather than a bug?"""
    try:
        from safetensors import SafetensorError
    except ImportError:  # older safetensors
        SafetensorError = ()  # noqa: N806
    return isinstance(exc, SafetensorError) or "error while deserializing" in str(exc).lower()


def check_layer_count(path: str | Path, config: dict) -> None:
    """Refuse an export whose ``config.json`` names another number of layers than its weights hold.

    transformers builds every layer the config names and fills the ones the weights lack with random
    values (with a warning); an edited count of 100,000 built layers until memory ran out. Only the
    weights files' headers are read here, before anything is built.
    """
    import json
    import re

    from safetensors import safe_open

    from ..modeling.hf import ADAPTER_WEIGHTS

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    files = [folder / ADAPTER_WEIGHTS] if config.get("adapter_only") else [folder / "model.safetensors"]
    if not config.get("adapter_only") and index.is_file():
        keys, shapes = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})), {}
    else:
        keys, shapes = set(), {}
        for file in files:
            if not file.is_file():
                raise DamagedFileError(f"{path}: {file.name} is missing; the export was copied in part: export it again")
            try:
                with safe_open(str(file), framework="pt") as f:
                    keys |= set(f.keys())
                    shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            except Exception as exc:  # safetensors' own error types for a garbled header
                why = str(exc).splitlines()[0]
                if config.get("adapter_only"):
                    raise DamagedFileError(f"{file} is damaged or truncated ({why}); export the adapter again") from exc
                raise DamagedFileError(f"{path}: its weights cannot be read ({why}); the export is damaged or was "
                                       "copied in part: export it again") from exc
    layers = {int(m.group(1)) for key in keys if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", key))}
    named = config.get("num_hidden_layers")
    if layers and named is not None and sorted(layers) != list(range(int(named))):
        raise DamagedFileError(f"{path}: config.json names {named} layers but the weights hold {len(layers)} "
                               f"(layers {min(layers)}..{max(layers)}); an edited or mismatched config would build "
                               "the missing layers with random weights: export it again")
    if shapes and not config.get("adapter_only"):
        _check_shapes(folder, shapes)


def _check_shapes(folder: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The weights' shapes (from the file's header) against those its ``config.json`` implies, compared on
    the meta device before anything is allocated (transformers would re-initialise the mismatched ones
    and stop with a report and a traceback)."""
    from ..modeling.hf import AcreConfig, AcreForCausalLM

    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in AcreForCausalLM(AcreConfig.from_pretrained(str(folder))).state_dict().items()}
    wrong = [(k, shapes[k], expected[k]) for k in sorted(shapes) if k in expected and shapes[k] != expected[k]]
    if wrong:
        name, held, implied = wrong[0]
        more = f" and {len(wrong) - 1} more" if len(wrong) > 1 else ""
        raise DamagedFileError(f"{folder}: its weights do not fit its config.json ({name}: {list(held)} in the "
                               f"weights, {list(implied)} by the config{more}); was config.json edited? export it again")


def load_for_inference(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                       placement: Placement | None = None, log=print):
    """``load_export``, or for a plain base model folder (e.g. ``acre-train base fetch``) the base with
    untrained L1 projections ("stage 0": copies of the base), so chat/generate work on any base."""
    from ..base.fetch import resolve_source

    path = resolve_source(str(path))
    try:
        return load_export(path, device=device, dtype=dtype, placement=placement)
    except NotAnAcreExport:
        config = Path(path) / "config.json"
        if not config.is_file():
            raise
    from transformers import AutoModelForCausalLM

    from ..modeling import attach_acre

    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=False,
                                                 **({"dtype": dtype} if dtype is not None else {}))
    model = _place(attach_acre(model), placement, dtype, device).eval()
    log(f"note: {path} is a base model, not an ACRE export: answering with untrained L1 projections (stage 0); "
        "train and export ACRE for a real bi-layer cache")
    tokenizer = None
    if any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        from ..data.tokenizer import auto_tokenizer

        tokenizer = auto_tokenizer(str(path))
    return model, tokenizer, {"acre": {"inference": {}}}


def _place(model, placement: Placement | None, dtype: torch.dtype | None, device: str | torch.device):
    """``model`` on ``device``; or, under a device map, dispatched by accelerate unless transformers already
    placed it while loading (full exports). Adapter-only exports and plain bases get their L1 weights
    after the base is loaded, so they are dispatched whole once built."""
    if placement is None or not placement.device_map:
        return model.to(device)
    if getattr(model, "hf_device_map", None):
        return model
    from accelerate import dispatch_model

    map_ = placement.kwargs(lambda: model, dtype)["device_map"]
    return dispatch_model(model, device_map=map_, offload_dir=placement.offload_folder)
