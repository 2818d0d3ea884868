"""Loading the recipe's tokenizer and fingerprinting it for the cache key."""

from __future__ import annotations

import hashlib
import re
import sys
import weakref
from typing import Any

from .errors import DataError


GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def auto_tokenizer(name: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained``, except that a folder whose ``tokenizer_config.json`` names
    a generic fast class is loaded as exactly that ``tokenizer.json``.

    Why: transformers 5 picks the tokenizer class from the ``model_type`` of a ``config.json`` in
    the same folder, and e.g. ``Qwen2Tokenizer`` rebuilds the pre-tokenizer with Qwen's own regex --
    a tokenizer trained here and saved beside a Qwen2 model then splits text differently from how
    the model was trained (``"\\n\\n"`` becomes one token instead of two).
    """
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from ..base.fetch import resolve_source

    name = resolve_source(name)
    kwargs.setdefault("trust_remote_code", False)  # a folder's own code never runs (nor prompts on stdin)
    config = Path(name) / "tokenizer_config.json"
    if config.is_file():
        try:
            cls = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
        except (OSError, ValueError):
            cls = None
        if cls in GENERIC_FAST_CLASSES and (Path(name) / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(name, **kwargs)
    return AutoTokenizer.from_pretrained(name, **kwargs)


_LOADED: dict[tuple, Any] = {}


def _files_key(name: str) -> tuple:
    """What identifies a tokenizer's files now: the folder's tokenizer files and their change times
    (a hub name or ``tiny`` is its own key)."""
    from pathlib import Path

    from ..base.fetch import resolve_source

    folder = Path(resolve_source(name))
    files = sorted(folder.glob("tokenizer*")) + sorted(folder.glob("special_tokens_map.json")) if folder.is_dir() else []
    return (name, str(folder), *((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))


def load_tokenizer(name: str) -> Any:
    """``"tiny"`` / ``"tiny:<vocab>"``: :func:`tiny_tokenizer`; anything else: :func:`auto_tokenizer`.

    Loaded once per process and files: a real tokenizer takes seconds to parse, and a training run
    opens it several times (validation, the data key, preparation, export).
    """
    if name == "tiny" or name.startswith("tiny:"):
        return _load_tokenizer(name)  # quick to load, and a fresh object callers may change
    key = _files_key(name)
    if key not in _LOADED:
        _LOADED.clear()  # one at a time: a process rarely switches, and a tokenizer can hold 100s of MB
        _LOADED[key] = _load_tokenizer(name)
    return _LOADED[key]


def _load_tokenizer(name: str) -> Any:
    if name == "tiny" or name.startswith("tiny:"):
        from .tiny_tokenizer import tiny_tokenizer

        vocab = name.partition(":")[2]
        tok = tiny_tokenizer(int(vocab)) if vocab else tiny_tokenizer()
    else:
        try:
            tok = auto_tokenizer(name)
        except Exception as exc:  # many exception types: missing dir, offline hub, bad files
            raise DataError(f"could not load tokenizer {name!r}: {exc}") from exc
        if not getattr(tok, "is_fast", False):
            raise DataError(f"tokenizer {name!r} is not a fast tokenizer; label masks need offset mappings")
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token (needed as the default L1 id and separator)")
    # We tokenize whole documents on purpose: silence the "longer than model_max_length" warning.
    tok.model_max_length = sys.maxsize
    return tok


_BACKEND_HASHES: "weakref.WeakKeyDictionary[Any, tuple[int, Any]]" = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tok: Any) -> str:
    """Digest of everything about a tokenizer that changes token ids or chat rendering."""
    digest = _backend_hash(tok)
    for part in (tok.chat_template or "", str(tok.eos_token_id), str(tok.bos_token_id), str(tok.pad_token_id)):
        digest.update(b"\0" + str(part).encode("utf-8"))
    return digest.hexdigest()


def _backend_hash(tok: Any):
    """A SHA-256 fed with the backend's serialised form (vocabulary, merges, normalizer, pre-tokenizer).

    Kept per tokenizer object while its size is unchanged: serialising Qwen2.5's backend takes 0.1 s, paid
    by every preparation and validation otherwise. (Adding tokens changes the size and recomputes it; a
    backend edited in place by other means keeps the old state until the tokenizer is loaded again.)"""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its vocabulary is what it has
        return hashlib.sha256(repr(tok.get_vocab()).encode("utf-8"))
    size = len(tok)
    try:
        known = _BACKEND_HASHES.get(tok)
    except TypeError:  # an object that cannot be weakly referenced: no memo
        known = None
    if known is None or known[0] != size:
        known = (size, hashlib.sha256(backend.to_str().encode("utf-8")))
        try:
            _BACKEND_HASHES[tok] = known
        except TypeError:
            pass
    return known[1].copy()


def tokenizer_facts(tok: Any, name: str) -> dict[str, Any]:
    """Tokenizer facts for the manifest."""
    return {
        "name": name,
        "name_or_path": getattr(tok, "name_or_path", name),
        "fingerprint": tokenizer_fingerprint(tok),
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
    }


def open_tokenizer(settings: Any) -> tuple[Any, int, dict[str, Any]]:
    """``(tokenizer, L1 slot id, tokenizer facts)`` for a stage's settings (L1 id defaults to EOS)."""
    tok = load_tokenizer(settings.tokenizer)
    l1_id = tok.eos_token_id if settings.l1_token_id is None else settings.l1_token_id
    return tok, l1_id, tokenizer_facts(tok, settings.tokenizer)


PIECE_CHARS = 1 << 20  # characters of a document tokenized at once
_LINE_END = re.compile(r"[^\W_](?=\n)")


def split_at_line_ends(text: str, piece_chars: int) -> list[str]:
    r"""``text`` in pieces of about ``piece_chars`` characters, each cut between a letter or digit and the
    newline after it. No byte-level BPE pre-tokenizer (GPT-2's, Llama 3's, Qwen's) joins a word to a
    newline after it, so the pieces' tokens, concatenated, are the whole text's; a text with no such
    place within twice the piece size is cut there (a token at that cut may differ, as it may at every
    cut of a SentencePiece tokenizer's text).

    >>> split_at_line_ends("ab\ncd\n\nef", 3)
    ['ab\ncd', '\n\nef']
    """
    if len(text) <= piece_chars:
        return [text]
    out, start = [], 0
    while len(text) - start > piece_chars:
        found = _LINE_END.search(text, start + piece_chars - 1, start + 2 * piece_chars)
        cut = found.start() + 1 if found else start + 2 * piece_chars
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return [p for p in out if p]


class BatchEncoder:
    """Encodes batches of texts to token ids (no special tokens) inside ``datasets.map`` workers.

    Why not the tokenizer itself: ``datasets`` pickles a map's arguments once per worker job, and a
    transformers tokenizer object pickles slowly (seconds, in the parent, per job: two processes can run
    slower than one). Where the tokenizer has a Rust backend, this carries only that (a fraction of the
    cost) and calls its ``encode_batch_fast`` -- the wrapper's ``encode_batch`` without the character
    offsets, which stage 1 never reads (the same ids, faster: ``benchmarks/prep_throughput.py``) -- with truncation and
    padding off, as ``tokenizer(texts, add_special_tokens=False)`` has them.

    >>> BatchEncoder(tokenizer)(["some text", "more"])  # [[...], [...]]
    """

    def __init__(self, tokenizer: Any, piece_chars: int = PIECE_CHARS):
        from tokenizers import Tokenizer

        self.piece_chars = piece_chars

        rust = getattr(tokenizer, "_tokenizer", None)
        if isinstance(rust, Tokenizer):
            # The wrapper sets both again on each of its own calls, so the shared backend can be changed.
            rust.no_truncation()
            rust.no_padding()
            self.rust, self.tokenizer = rust, None
        else:
            self.rust, self.tokenizer = None, tokenizer

    def __call__(self, texts: list[str]) -> list[list[int]]:
        pieces, owners = [], []
        for i, text in enumerate(texts):  # a long document goes in pieces: memory bounded by the piece
            for piece in split_at_line_ends(text, self.piece_chars):
                pieces.append(piece)
                owners.append(i)
        ids = self._encode(pieces)
        if len(pieces) == len(texts):
            return ids
        out: list[list[int]] = [[] for _ in texts]
        for owner, piece_ids in zip(owners, ids):
            out[owner].extend(piece_ids)
        return out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.rust is not None:
            encode = getattr(self.rust, "encode_batch_fast", self.rust.encode_batch)  # (tokenizers < 0.21: no fast)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

