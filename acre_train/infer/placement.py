"""Big-model placement: a model over several devices, the CPU or disk, through accelerate's device map.

``--device-map auto --max-memory 0=20GiB,cpu=60GiB --offload-folder DIR`` (``chat``, ``generate``,
``eval``, ``calibrate``) loads a model larger than one device the way transformers does
(``from_pretrained(device_map=...)``): each block's weights stay where the map puts them and move to
its execution device while it runs.

What ACRE adds: its forward calls the embedding, each decoder layer, the final norm and the LM head
itself (not the model's own ``forward``), and reads the one-row L1 embedding directly. So the map is
refined until every one of those modules is an entry of its own (each gets its own hook), and the L1
embedding row is never offloaded.

Tested on CPU with blocks forced onto disk (``tests/test_placement.py``). A map over several GPUs is
not tested (no multi-GPU machine here): the bi-layer cache lives on the embedding's device.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# Module names, relative to the top model, that ACRE's forward calls directly.
_UNITS = ("model.embed_tokens", "model.acre_embed_tokens", "model.norm", "model.rotary_emb", "lm_head")
_OFFLOADED = ("cpu", "disk")


@dataclass(frozen=True)
class Placement:
    """Where a model's weights go: ``device_map`` (``auto``, ``balanced``, ``sequential`` or a JSON map of
    module name -> device), the most each device may hold, and the folder for weights offloaded to disk."""

    device_map: str | None = None
    max_memory: dict[int | str, str] | None = None
    offload_folder: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Placement | None":
        if not getattr(args, "device_map", None):
            if getattr(args, "max_memory", None) or getattr(args, "offload_folder", None):
                raise ValueError("--max-memory and --offload-folder apply with --device-map (e.g. --device-map auto)")
            return None
        return cls(args.device_map, parse_max_memory(args.max_memory), args.offload_folder)

    def kwargs(self, skeleton: Callable[[], nn.Module], dtype: torch.dtype | None) -> dict[str, Any]:
        return placement_kwargs(skeleton, device_map=self.device_map, max_memory=self.max_memory,
                                offload_folder=self.offload_folder, dtype=dtype)


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device-map``, ``--max-memory``, ``--offload-folder`` (one spelling for every verb that loads)."""
    group = parser.add_argument_group("big models (accelerate device map)")
    group.add_argument("--device-map", default=None, metavar="auto|balanced|sequential|JSON",
                       help="spread the model over GPUs, CPU and disk as accelerate does (default: all on --device)")
    group.add_argument("--max-memory", default=None, metavar="DEV=AMOUNT,...",
                       help="the most each device may hold, e.g. 0=20GiB,1=20GiB,cpu=60GiB")
    group.add_argument("--offload-folder", default=None, metavar="DIR",
                       help="where weights that fit nowhere else are kept (needed when the map offloads to disk)")


def parse_max_memory(text: str | None) -> dict[int | str, int | str] | None:
    """``"0=20GiB,cpu=60GiB"`` -> ``{0: "20GiB", "cpu": "60GiB"}`` (accelerate's ``max_memory``).

    >>> parse_max_memory("0=20GiB,cpu=60GiB")
    {0: '20GiB', 'cpu': '60GiB'}
    """
    if not text:
        return None
    out: dict[int | str, int | str] = {}
    for part in text.split(","):
        device, sep, amount = part.strip().partition("=")
        if not sep or not device or not amount:
            raise ValueError(f"--max-memory: expected DEVICE=AMOUNT[,DEVICE=AMOUNT...] (e.g. 0=20GiB,cpu=60GiB), "
                            f"got {part!r}")
        out[int(device) if device.isdigit() else device] = int(amount) if amount.isdigit() else amount  # bytes
    return out


def requested_device(name: str | None) -> torch.device:
    """``--device``: ``None``/``auto`` is CUDA where there is one, else the CPU; a device this machine
    lacks is a one-line error before anything loads (torch's own is an ``AssertionError`` mid-load)."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "it sees no GPU"
            raise ValueError(f"--device {name}: no CUDA device here ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: no Apple GPU (MPS) here; use --device cpu")
    return device


def execution_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: the device its embedding computes on.

    Without a device map that is where the weights are. With one, weights may be on the meta device
    (offloaded to disk) or spread over GPUs; accelerate's hooks name each block's execution device.
    """
    embed = model.get_input_embeddings()
    owner = [name for name, module in model.named_modules() if module is embed]
    prefix = owner[0] if owner else ""
    best: tuple[int, Any] | None = None
    for name, module in model.named_modules():
        device = _hook_device(getattr(module, "_hf_hook", None))
        if device is not None and (name == "" or prefix == name or prefix.startswith(name + ".")):
            if best is None or len(name) > best[0]:
                best = (len(name), device)
    if best is not None:
        device = best[1]
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _inner_hooks(hook: Any) -> tuple[Any, ...]:
    """The accelerate hooks in ``hook`` (a SequentialHook holds several; None holds none)."""
    if hook is None:
        return ()
    return tuple(getattr(hook, "hooks", None) or (hook,))


def _hook_device(hook: Any) -> Any:
    devices = [getattr(inner, "execution_device", None) for inner in _inner_hooks(hook)]
    return next((d for d in devices if d is not None), None)


def offloaded_tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    """The stored value of state-dict entry ``name`` whose parameter a device map left on the meta device
    (read from the offload of the hook that brings it in), or None when no hook holds it."""
    *path, leaf = name.split(".")
    for depth in range(len(path), -1, -1):  # the hook sits on the module itself or on a block above it
        for inner in _inner_hooks(getattr(model.get_submodule(".".join(path[:depth])), "_hf_hook", None)):
            weights = getattr(inner, "weights_map", None)
            if weights is not None:
                try:
                    return weights[".".join([*path[depth:], leaf])]
                except KeyError:
                    pass
    return None


def refine_device_map(device_map: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``device_map`` with every module ACRE's forward calls directly as an entry of its own, and the
    L1 embedding row on the main (first non-offloaded) device."""
    units = [u for u in _UNITS if _has_module(model, u)]
    units += [f"model.layers.{i}" for i in range(len(model.model.layers))]
    refined: dict[str, Any] = {}
    for name, device in device_map.items():
        covered = [u for u in units if name == "" or u == name or u.startswith(name + ".")]
        if covered and not (len(covered) == 1 and covered[0] == name):
            for unit in covered:
                refined.setdefault(unit, device)
        else:
            refined[name] = device
    devices = [d for d in refined.values() if d not in _OFFLOADED]
    main = devices[0] if devices else "cpu"
    if "model.acre_embed_tokens" in refined:
        refined["model.acre_embed_tokens"] = main  # one row; ACRE reads its weight directly
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in refined and "model.embed_tokens" in refined:
        refined["lm_head"] = refined["model.embed_tokens"]  # one tensor: one place
    return refined


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def placement_kwargs(skeleton: Callable[[], nn.Module], *, device_map: str | None, max_memory: dict | None,
                     offload_folder: str | None, dtype: torch.dtype | None) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that place the model ``skeleton()`` builds (called on the meta
    device) by ``device_map`` (``auto``, ``balanced``, ``sequential``, or a JSON map), refined for ACRE."""
    if not device_map:
        return {}
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import get_balanced_memory

    with init_empty_weights():
        model = skeleton()
    if dtype is not None:
        model.to(dtype)
    if device_map.lstrip().startswith("{"):
        import json

        chosen: dict[str, Any] = json.loads(device_map)
    else:
        if device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise ValueError(f"--device-map: expected auto, balanced, balanced_low_0, sequential or a JSON map, "
                             f"got {device_map!r}")
        layer_classes = sorted({type(layer).__name__ for layer in model.model.layers})
        if device_map != "sequential":  # as transformers does: spread evenly over the GPUs first
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=layer_classes,
                                             dtype=dtype, low_zero=device_map == "balanced_low_0")
        chosen = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=layer_classes, dtype=dtype)
    refined = refine_device_map(chosen, model)
    if any(device == "disk" for device in refined.values()) and not offload_folder:
        raise ValueError("the device map offloads weights to disk: name a folder for them with --offload-folder")
    return {"device_map": refined, **({"offload_folder": offload_folder} if offload_folder else {})}


def describe(device_map: dict[str, Any]) -> str:
    """One line: how many blocks went where (``"cpu: 3, disk: 4 of 7 blocks"``)."""
    counts: dict[str, int] = {}
    for device in device_map.values():
        counts[str(device)] = counts.get(str(device), 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) + f" of {len(device_map)} blocks"

