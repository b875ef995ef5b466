"""Deterministic synthetic text and token counting for the simulated node.

Replies must be reproducible (the same model, messages and seed give the same reply, on any
machine and Python version), so everything here is driven by a `random.Random` seeded from a
BLAKE2 digest of the request, never by `hash()` or the global generator.

Token rules (documented because tests and benchmarks count on them):
- a *prompt* token is a run of word characters or a single other non-space character
  (`\\w+|[^\\w\\s]`), summed over the text of every message, its tool calls and the tool
  definitions, plus 4 tokens of framing per message;
- a generated *text* token is one word (the first without, the others with a leading space;
  punctuation sticks to its word);
- generated JSON (structured output, tool arguments) is split into tokens of optional leading
  whitespace plus a run of word characters or a run of other non-space characters
  (`{"`, `city`, `":`, ` "`, `Paris`, `"}`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "WORDS",
    "count_prompt_tokens",
    "json_pieces",
    "message_text",
    "request_rng",
    "synth_tokens",
]

WORDS: tuple[str, ...] = (
    "the", "model", "routes", "a", "request", "to", "node", "with", "spare", "capacity",
    "and", "latency", "budget", "fleet", "policy", "accelerator", "family", "tokens", "stream",
    "queue", "slot", "prefill", "decode", "cache", "batch", "throughput", "answer", "simple",
    "quiet", "river", "stone", "light", "garden", "paper", "window", "morning", "signal",
    "bridge", "harbor", "lantern", "meadow", "orbit", "pattern", "quantum", "ripple", "summit",
    "timber", "velvet", "whisper", "yonder", "zephyr", "of", "in", "on", "is", "was", "for",
    "it", "as", "by", "from", "this", "that", "every", "small", "large", "warm", "clear", "bright",
    "steady", "careful", "gentle", "rapid", "silent", "open", "distant", "golden", "hidden",
    "café", "naïve", "über", "façade", "smörgåsbord", "東京", "数据", "смысл", "λόγος", "🚀",
)
"""The vocabulary of synthetic text (a few non-ASCII words on purpose)."""

_PROMPT_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_JSON_PIECE_RE = re.compile(r"\s*(?:\w+|[^\w\s]+)|\s+$")


def request_rng(model: str, messages: Sequence[Any], seed: int, choice: int = 0) -> random.Random:
    """A generator seeded by (model, messages, seed): equal inputs give equal replies.

    `choice` > 0 gives the generator of another choice of the same request (`n` > 1); choice 0
    is the generator of a request with `n` = 1, so its first choice is the same reply.
    """
    key: list[Any] = [model, messages, seed] if choice == 0 else [model, messages, seed, choice]
    blob = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.blake2b(blob.encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


def message_text(message: Mapping[str, Any]) -> str:
    """The text of a message's content: a string, or the text parts of a content list."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return ""


def count_prompt_tokens(messages: Iterable[Mapping[str, Any]], tools: Any = None) -> int:
    """Deterministic prompt size (see the module docstring for the rule)."""
    total = 0
    for message in messages:
        total += 4 + len(_PROMPT_TOKEN_RE.findall(message_text(message)))
        tool_calls = message.get("tool_calls")
        if tool_calls:
            total += len(_PROMPT_TOKEN_RE.findall(json.dumps(tool_calls, default=str)))
    if tools:
        total += len(_PROMPT_TOKEN_RE.findall(json.dumps(tools, default=str)))
    return total


def synth_tokens(rng: random.Random, n: int) -> list[str]:
    """`n` text tokens of prose: capitalised sentences of 5-13 words, the last one closed.

    Drawn a sentence at a time, so a shorter reply is a prefix of a longer one (up to the
    closing period).
    """
    tokens: list[str] = []
    while len(tokens) < n:
        sentence = rng.choices(WORDS, k=rng.randint(5, 13))
        sentence[0] = sentence[0][:1].upper() + sentence[0][1:]
        sentence[-1] += "."
        tokens += sentence
    del tokens[n:]
    if tokens and not tokens[-1].endswith("."):
        tokens[-1] += "."
    return [tokens[0], *(" " + t for t in tokens[1:])] if tokens else tokens


def json_pieces(text: str) -> list[str]:
    """Split JSON text into tokens whose concatenation is `text` exactly."""
    return _JSON_PIECE_RE.findall(text)
