"""Token log-probabilities of a simulated reply, shaped as vLLM's and OpenAI's `logprobs`.

Clients and adapters (LangChain's `response_metadata["logprobs"]`, LlamaIndex's
`response.logprobs`) need to see the real shape, so the node returns it when a request sets
`logprobs: true` (and `top_logprobs: k`, 0-20):

    {"content": [{"token": " river", "logprob": -0.31, "bytes": [32, 114, ...],
                  "top_logprobs": [{"token": " river", "logprob": -0.31, "bytes": [...]},
                                   {"token": " stone", "logprob": -1.9, "bytes": [...]}, ...]},
                 ...]}

Rules (deterministic: drawn from a generator the planner seeds from the request):
- one entry per content token, in order (a reply of tool calls has `"content": []`);
- `bytes` is the token's UTF-8 encoding; every logprob is <= 0;
- `top_logprobs` lists k alternatives, most likely first: the sampled token itself (the node
  samples greedily), then k-1 other words of the vocabulary, each strictly less likely than
  the one before, none equal to the sampled token.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from zml.sim.textgen import WORDS

__all__ = ["MAX_TOP_LOGPROBS", "content_logprobs"]

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for per token (OpenAI's and vLLM's default cap)."""


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _alternatives(token: str, logprob: float, top: int, rng: random.Random) -> list[dict[str, Any]]:
    if top == 0:
        return []
    lead = " " if token.startswith(" ") else ""
    words = [lead + w for w in rng.sample(WORDS, min(len(WORDS), top + 1))]
    out = [_entry(token, logprob)]
    value = logprob
    for word in words:
        if len(out) == top:
            break
        if word == token:
            continue
        value = round(value - rng.uniform(0.25, 2.5), 4)
        out.append(_entry(word, value))
    return out


def content_logprobs(pieces: Sequence[str], top: int, rng: random.Random) -> list[dict[str, Any]]:
    """One logprobs entry per token of `pieces`, each with `top` alternatives."""
    entries = []
    for token in pieces:
        logprob = -round(rng.expovariate(4.0), 4)
        entry = _entry(token, logprob)
        entry["top_logprobs"] = _alternatives(token, logprob, top, rng)
        entries.append(entry)
    return entries
