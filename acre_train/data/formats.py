"""Stage-2 input formats -> a list of ``{"role", "content"}`` messages.

* ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI / HF chat layout)
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}``
* ``alpaca`` (also LongAlpaca): ``{"instruction", "input" (optional), "output"}``
"""

from __future__ import annotations

from typing import Any

from .errors import DataError
from .chat import Message

_SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
    "system": "system",
}
_ROLES = {"system", "user", "assistant"}


def detect_format(record: dict[str, Any]) -> str:
    """``messages``, ``sharegpt`` or ``alpaca`` from the record's keys."""
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise DataError(
        f"unrecognised record (keys: {', '.join(sorted(record)) or 'none'}); expected 'messages', "
        "'conversations' or 'instruction'+'output'"
    )


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{what} must be a string, got {type(value).__name__}")
    return value


def from_messages(record: dict[str, Any]) -> list[Message]:
    turns = record.get("messages")
    if not isinstance(turns, list) or not turns:
        raise DataError("'messages' must be a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DataError(f"messages[{i}] needs 'role' and 'content'")
        role = _text(turn["role"], f"messages[{i}].role")
        if role not in _ROLES:
            raise DataError(f"messages[{i}].role {role!r} is not one of {sorted(_ROLES)}")
        out.append({"role": role, "content": _text(turn["content"], f"messages[{i}].content")})
    return out


def from_sharegpt(record: dict[str, Any]) -> list[Message]:
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise DataError("'conversations' must be a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(f"conversations[{i}] needs 'from' and 'value'")
        speaker = _text(turn["from"], f"conversations[{i}].from").lower()
        if speaker not in _SHAREGPT_ROLES:
            raise DataError(f"conversations[{i}].from {speaker!r} is not a known speaker")
        out.append({"role": _SHAREGPT_ROLES[speaker], "content": _text(turn["value"], f"conversations[{i}].value")})
    if "system" in record and isinstance(record["system"], str) and record["system"]:
        out.insert(0, {"role": "system", "content": record["system"]})
    return out


def from_alpaca(record: dict[str, Any]) -> list[Message]:
    for key in ("instruction", "output"):
        if key not in record:
            raise DataError(f"missing field {key!r}")
    instruction = _text(record["instruction"], "instruction")
    extra = record.get("input") or ""
    user = f"{instruction}\n\n{_text(extra, 'input')}" if extra else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": _text(record["output"], "output")}]


CONVERTERS = {"messages": from_messages, "sharegpt": from_sharegpt, "alpaca": from_alpaca}


def to_messages(record: dict[str, Any], fmt: str = "auto", system_prompt: str | None = None) -> list[Message]:
    """Convert one record; raises :class:`DataError` saying what is wrong with it."""
    fmt = detect_format(record) if fmt == "auto" else fmt
    messages = CONVERTERS[fmt](record)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant turn")
    if not any(m["content"].strip() for m in messages if m["role"] == "assistant"):
        raise DataError("empty assistant answer")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
