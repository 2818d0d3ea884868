"""The data's tokenizer against the model: a dataset tokenized for another vocabulary must not train.

A prepared dataset's manifest records its tokenizer (name, fingerprint, size). Token ids from another
tokenizer of the same size train to "done" on nonsense; a larger one crashes at the first step with an
``IndexError`` deep in the embedding. ``validate`` and the start of ``train`` compare instead: the
largest id in the data (and the L1 token id) against the model's embedding rows, and, where the base
folder has a tokenizer of its own, the two fingerprints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .recipe_schema import Recipe


def data_vocabulary(path: str | Path, manifest: dict[str, Any] | None = None, dataset=None) -> tuple[dict, int]:
    """``(the manifest's tokenizer facts, the largest token id in the data)``."""
    import pyarrow.compute as pc

    from ..data import load_prepared

    if manifest is None or dataset is None:
        dataset, manifest = load_prepared(path)
    column = dataset.data.column("input_ids")
    largest = pc.max(pc.list_flatten(column)).as_py() if len(dataset) else -1
    l1 = (manifest.get("plan") or {}).get("l1_token_id")
    return manifest.get("tokenizer") or {}, max(int(largest if largest is not None else -1), int(l1 if l1 is not None else -1))


def base_vocabulary(recipe: Recipe) -> tuple[int, str | None]:
    """``(embedding rows, the base folder's tokenizer fingerprint or None)``, from the config alone."""
    source = recipe.model.source
    if source.startswith("tiny:"):
        from ..tiny import tiny_config

        return int(tiny_config(source.partition(":")[2], **recipe.model.tiny_config).vocab_size), None
    from transformers import AutoConfig

    from ..base.fetch import resolve_source

    folder = resolve_source(source)
    rows = int(AutoConfig.from_pretrained(folder, trust_remote_code=False).vocab_size)
    return rows, base_tokenizer_fingerprint(folder)


def base_tokenizer_fingerprint(folder: str) -> str | None:
    """The fingerprint of the tokenizer saved beside a base (None: the folder has none)."""
    if not any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from ..data.tokenizer import auto_tokenizer, tokenizer_fingerprint

    return tokenizer_fingerprint(auto_tokenizer(folder))


def vocabulary_problems(recipe: Recipe, rows: int, fingerprint: str | None, facts: dict, largest: int) -> list[str]:
    """What is wrong between data made with tokenizer ``facts`` (ids up to ``largest``) and a model with
    ``rows`` embedding rows whose base tokenizer has ``fingerprint`` (empty list: they agree)."""
    data_name = facts.get("name") or facts.get("name_or_path") or "an unrecorded tokenizer"
    where = f"data.path {recipe.data.path} (tokenized with {data_name})"
    problems = []
    if largest >= rows:
        problems.append(f"{where} holds token id {largest}, but model.source {recipe.model.source} has {rows} "
                        "embedding rows: prepare the data with the model's tokenizer")
    elif fingerprint is not None and facts.get("fingerprint") and facts["fingerprint"] != fingerprint:
        problems.append(f"{where} was made with another tokenizer than model.source {recipe.model.source}'s own "
                        f"(fingerprints {facts['fingerprint'][:12]} and {fingerprint[:12]}; sizes "
                        f"{facts.get('vocab_size', '?')} and its {rows} embedding rows): prepare the data with the "
                        "model's tokenizer")
    return problems


def check_vocabulary(recipe: Recipe) -> list[str]:
    """``vocabulary_problems`` for a recipe whose ``data.path`` is prepared (``validate``); [] otherwise."""
    from ..data.output import read_manifest

    if read_manifest(Path(recipe.data.path)) is None:
        return []  # prepared on first use, with data.prepare.tokenizer: checked when train starts
    facts, largest = data_vocabulary(recipe.data.path)
    rows, fingerprint = base_vocabulary(recipe)
    return vocabulary_problems(recipe, rows, fingerprint, facts, largest)
