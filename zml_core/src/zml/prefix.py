"""Prefix-block ids of a live chat prompt, for ``affinity = "prefix"`` routing.

Routing with prefix affinity sends prompts that start alike to the same node, where an
inference server's prefix cache (vLLM's automatic prefix caching) already holds their leading
blocks. A trace brings its block ids; a live request gets them from this rule, the same one
the simulated node uses for its prefix cache (``zml.sim.model.prompt_blocks``), so that a
routed prefix and a cached prefix are the same thing:

* the prompt is rendered as each message's role, then its text (a list of parts: their
  ``text`` joined by spaces);
* it is cut into tokens: a run of word characters, or one other non-space character;
* full blocks of ``BLOCK_TOKENS`` (512) tokens get an id: the BLAKE2b digest (12 bytes, hex)
  of the previous block's digest and the block's tokens joined by U+001F, so equal ids mean an
  equal prompt up to and including that block. A prompt shorter than one block has none.

This module is small on purpose: the core imports it without importing the simulator.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["BLOCK_TOKENS", "blocks_of_body", "prompt_blocks"]

BLOCK_TOKENS = 512
"""Tokens per prefix block (vLLM's and Mooncake's block size)."""

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def prompt_blocks(messages: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The ids of the prompt's full 512-token blocks, in order (module docs)."""
    tokens: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content
                               if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        elif not isinstance(content, str):
            content = ""
        tokens.append(str(message.get("role", "")))
        tokens += _TOKEN_RE.findall(content)
    ids: list[str] = []
    previous = b""
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        digest = hashlib.blake2b(
            previous + "\x1f".join(tokens[start:start + BLOCK_TOKENS]).encode(), digest_size=12
        )
        previous = digest.digest()
        ids.append(digest.hexdigest())
    return tuple(ids)


def blocks_of_body(body: bytes) -> tuple[str, ...]:
    """The prefix blocks of an encoded chat-completion body (``()`` if it has no messages)."""
    try:
        messages = json.loads(body).get("messages")
    except (ValueError, AttributeError):
        return ()
    if not isinstance(messages, list):
        return ()
    return prompt_blocks(m for m in messages if isinstance(m, Mapping))
