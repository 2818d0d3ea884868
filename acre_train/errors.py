"""What a user can fix, and how the CLI reports it: one line on stderr and exit code 2.

``acre-train`` applies :func:`user_errors` once, around every verb (``cli.main``); tracebacks are kept
for bugs. A user error is a ``ValueError`` (bad setting, damaged or malformed file: the project's own
``RecipeError``, ``DataError``, ``BaseError``... derive from it), an ``OSError`` (missing file, a
folder where a file was expected, no permission, a full disk), a damaged safetensors file, or a
missing optional dependency (:class:`MissingExtra`, which names the ``pip install``).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import sys
from typing import Any, Callable

EXIT_USER_ERROR = 2
EXIT_PEER_LOST = 3  # a distributed peer died: the run is resumable, but not by this process
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process the signal ended


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, ``kill``), handled as Ctrl-C is: the finished step is saved."""


def sigterm_as_interrupt():
    """A context manager: within it, SIGTERM raises :class:`Terminated` in the main thread (elsewhere, or
    where signals cannot be set, it changes nothing); the earlier handler comes back after."""
    import contextlib
    import signal
    import threading

    @contextlib.contextmanager
    def scope():
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):  # noqa: ARG001
            raise Terminated()

        before = signal.signal(signal.SIGTERM, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, before)

    return scope()


def key_hint(key: str, known, *, cutoff: float = 0.6) -> str:
    """The tail of an unknown-key error: a did-you-mean when one is close, else the known keys.

    >>> key_hint("strid", ["stride", "first_chunk"]), key_hint("zzz", ["b", "a"])
    ("; did you mean 'stride'?", '; known: a, b')
    """
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=cutoff)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"


class PeerLost(RuntimeError):
    """Another rank died, was killed, or became unreachable: this rank stops instead of hanging."""


def explain_validation(exc: Any, root: Any) -> list[str]:
    """One readable line per error of a pydantic ``ValidationError`` raised validating ``root`` (a model
    class), with a did-you-mean for unknown keys -- the one wording for recipes and data settings.

    >>> explain_validation(err, Recipe)
    ["train.learnig_rate: unknown key; did you mean 'learning_rate'?"]
    """
    return [_explain(err, root) for err in exc.errors()]


def _explain(err: dict[str, Any], root: Any) -> str:
    loc = [str(p) for p in err["loc"]]
    where = f"{'.'.join(loc)}: " if loc else ""  # a check across fields has no key of its own
    if err["type"] == "extra_forbidden":
        return f"{where}unknown key{key_hint(loc[-1], _fields_at(root, loc[:-1]), cutoff=0.5)}"
    if err["type"] == "missing":
        return f"{where}required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    return f"{where}{message}" if err["type"] == "value_error" else f"{where}{message} (got {err.get('input')!r})"


def _fields_at(root: Any, loc: list[str]) -> list[str]:
    """Field names of the (nested) model at ``loc`` below ``root``."""
    from pydantic import BaseModel

    model = root
    for part in loc:
        annotation = getattr(model.model_fields.get(part), "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that fixes it."""


def require(module: str, extra: str) -> Any:
    """Import ``module`` or raise :class:`MissingExtra` naming ``pip install 'acre-train[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = module.split(".")[0]
        raise MissingExtra(f"this needs the '{package}' package: pip install 'acre-train[{extra}]'") from exc


def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ValueError, OSError, MissingExtra]
    try:
        from safetensors import SafetensorError  # a damaged model.safetensors / adapter file

        types.append(SafetensorError)
    except ImportError:  # older safetensors: the error is then a ValueError / OSError anyway
        pass
    return tuple(types)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    return text


def user_errors(run: Callable[..., int], verb: str = "") -> Callable[..., int]:
    """``run`` with the policy applied: user errors print ``acre-train VERB: error: ...`` and return 2;
    Ctrl-C returns 130 and SIGTERM 143 (what was saved has been said); a lost distributed peer returns 3."""

    @functools.wraps(run)
    def wrapper(args: Any, *rest: Any, **kw: Any) -> int:
        name = verb or getattr(args, "verb", "") or ""
        prefix = f"acre-train {name}: " if name else "acre-train: "
        try:
            return run(args, *rest, **kw)
        except Terminated:
            return EXIT_TERMINATED
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except PeerLost as exc:
            print(f"{prefix}error: {exc}", file=sys.stderr)
            return EXIT_PEER_LOST
        except _user_error_types() as exc:
            print(f"{prefix}error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USER_ERROR

    return wrapper
