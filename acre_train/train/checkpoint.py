"""Checkpoints: trainable weights + optimizer + scheduler + RNG + data position, never the frozen base.

Layout of a run directory (``<output_root>/<run_name>/``)::

    recipe.yaml                  the resolved recipe of the latest launch
    base_model/                  tiny:<arch> sources only: the base model (save_pretrained), for later stages/export
    metrics.jsonl                one JSON line per logged step (rank 0)
    tensorboard/                 event files
    latest                       text: the name of the newest complete checkpoint
    checkpoint-<step>/
        acre_checkpoint.json     written last: step, data position, base-model reference, engine, shapes
        recipe.yaml              the recipe that wrote it
        trainable.safetensors    the trainable weights (ACRE: exactly acre_state_dict(model)); rank 0
        rng_state_<rank>.json    python/numpy RNG of every rank (plain JSON: nothing is unpickled on resume)
        rng_state_<rank>.safetensors   torch(/cuda) RNG of every rank
        optimizer.pt scheduler.pt          without DeepSpeed
        ds/latest ds/state/...             with DeepSpeed: save_checkpoint(exclude_frozen_parameters=True)

Writing is atomic: everything goes to ``.checkpoint-<step>.partial`` and is renamed into place once
every rank has finished, so a crash never leaves a directory that looks complete. An exporter reads
``trainable.safetensors`` (or, for fp32 master weights of a bf16 DeepSpeed run,
``get_fp32_state_dict_from_zero_checkpoint(checkpoint-<step>/ds)``) plus ``base_model`` in
``acre_checkpoint.json``.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..files import DiskFullError, disk_errors, publish_dir, read_safetensors, write_text_atomic

FORMAT_VERSION = 1
META = "acre_checkpoint.json"
WEIGHTS = "trainable.safetensors"
DS_DIR = "ds"
DS_TAG = "state"
LATEST = "latest"


class CheckpointMismatch(ValueError):
    """A checkpoint that cannot continue this recipe; the message lists every reason."""


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (partial ones have no META and are skipped)."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if (p / META).is_file() and p.name[11:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[11:]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def read_meta(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / META
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete acre-train checkpoint (no {META})")
    return json.loads(path.read_text(encoding="utf-8"))


def find_weights_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory's newest checkpoint (stage 2's ``init_from``)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    newest = latest_checkpoint(path) if path.is_dir() else None
    if newest is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint directory nor a run directory with a complete checkpoint")
    return newest


def damage(checkpoint: Path, with_optimizer: bool = True) -> str | None:
    """What is wrong with a checkpoint's files (None: they all read back)."""
    from safetensors import safe_open

    try:
        read_meta(checkpoint)
        with safe_open(str(Path(checkpoint) / WEIGHTS), framework="pt") as f:
            for key in f.keys():
                f.get_tensor(key)
        if with_optimizer:
            for name in ("optimizer.pt", "scheduler.pt"):
                torch.load(Path(checkpoint) / name, map_location="cpu", weights_only=True)
    except Exception as exc:  # json, safetensors, zip/pickle errors of a damaged file
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def resolve_resume(run_dir: Path, resume: str | None) -> Path | None:
    """``None``, ``"latest"`` (None when the run has no checkpoint yet: a fresh start) or a path."""
    if not resume:
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    return find_weights_checkpoint(Path(resume))


# ------------------------------------------------------------------------------------------ saving


def save_rng(folder: Path, rank: int) -> None:
    """Every RNG of this rank as JSON (python, numpy) + safetensors (torch, cuda): no pickle anywhere."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(internal), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    (folder / f"rng_state_{rank}.json").write_text(json.dumps(plain), encoding="utf-8")
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(tensors, str(folder / f"rng_state_{rank}.safetensors"))


def restore_rng(folder: Path, rank: int) -> bool:
    """Restore what :func:`save_rng` wrote; False when this rank has no saved state."""
    plain_file = Path(folder) / f"rng_state_{rank}.json"
    if not plain_file.is_file():
        return False
    plain = json.loads(plain_file.read_text(encoding="utf-8"))
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    tensors = load_file(str(Path(folder) / f"rng_state_{rank}.safetensors"))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return True


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    rank: int,
    barrier: Callable[[], None],
    trainable: dict[str, torch.Tensor],
    meta: dict[str, Any],
    recipe_yaml: str,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    engine: Any = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``checkpoint-<step>`` atomically; every rank must call it. Returns the final path."""
    run_dir = Path(run_dir)
    final = run_dir / checkpoint_name(step)
    tmp = run_dir / f".{final.name}.partial"  # one name every rank knows: atomic_dir cannot serve several ranks
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    barrier()
    try:
        with disk_errors(f"{final} (the previous checkpoint, if any, is intact)"):
            save_rng(tmp, rank)
            if engine is not None:
                # Only the trainable parameters; ZeRO-1/2 optimizer shards are written by every rank.
                engine.save_checkpoint(str(tmp / DS_DIR), tag=DS_TAG, exclude_frozen_parameters=True)
            elif rank == 0:
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
                torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
            if rank == 0:
                save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()}, str(tmp / WEIGHTS))
                (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
    except DiskFullError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if rank == 0:
        try:
            with disk_errors(f"{final} (the previous checkpoint, if any, is intact)"):
                (tmp / META).write_text(json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=2) + "\n",
                                        encoding="utf-8")
        except DiskFullError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_dir(tmp, final)
        write_text_atomic(run_dir / LATEST, final.name + "\n")
        if keep_last:
            # Only older steps are pruned, never the checkpoint just written: the newest keep_last
            # steps up to this one stay.
            older = [c for c in list_checkpoints(run_dir) if int(c.name[11:]) < step]
            for old in older[:max(0, len(older) - (keep_last - 1))]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final




# ----------------------------------------------------------------------------------------- loading


def load_trainable(checkpoint: Path) -> dict[str, torch.Tensor]:
    return read_safetensors(Path(checkpoint) / WEIGHTS)


def load_rng(checkpoint: Path, rank: int) -> None:
    restore_rng(checkpoint, rank)  # a rank beyond the saving world size keeps its fresh seed


# Recipe keys a resume may change (prefix match): bookkeeping, step budget, how the same math is run.
# Data and base changes are caught by the identity fields (data fingerprint, base reference).
RESUME_MAY_CHANGE = (
    "run_name", "output_root", "train.max_steps", "train.epochs", "train.micro_batch_size",
    "train.gradient_accumulation_steps", "train.deepspeed", "train.liger.", "train.dist_timeout_s", "logging.",
    "checkpoint.", "data.",
    "model.init_from", "model.kernel", "model.gradient_checkpointing", "model.attn_implementation", "model.save_base",
)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def recipe_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(changes a resume applies, changes it refuses) between a checkpoint's recipe and the current one."""
    old, new = _flatten(saved), _flatten(current)
    applied, refused = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            line = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
            (applied if key.startswith(RESUME_MAY_CHANGE) else refused).append(line)
    return applied, refused


def check_compatible(meta: dict[str, Any], expected: dict[str, Any], checkpoint: Path) -> None:
    """Raise :class:`CheckpointMismatch` naming every field where ``meta`` differs from ``expected``.

    ``expected`` holds the identity fields of the current run (see ``Trainer.identity``); a field
    absent from the checkpoint is a mismatch too (other format or tool).
    """
    reasons = []
    if meta.get("format_version") != FORMAT_VERSION:
        reasons.append(f"format_version {meta.get('format_version')} (this acre-train writes {FORMAT_VERSION})")
    saved = meta.get("identity", {})
    for key, value in expected.items():
        if saved.get(key) != value:
            reasons.append(f"{key}: checkpoint has {saved.get(key)!r}, the recipe gives {value!r}")
    if reasons:
        raise CheckpointMismatch(
            f"checkpoint {checkpoint} does not match this recipe:\n" + "\n".join(f"  - {r}" for r in reasons)
            + "\nstart a new run_name, or resume with the recipe that wrote it (see its recipe.yaml)"
        )
