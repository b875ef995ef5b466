"""Async streams whose ``aclose()`` frees the node's slot before it returns.

LlamaIndex's callback decorators (``llm_chat_callback``, ``llm_completion_callback``) wrap the
async generator a method returns in one of their own, which iterates ours but never closes
it: ``aclose()`` on theirs leaves ours suspended until Python finalizes it, an event-loop turn
later, and the zml stream, a slot on a node, stays open until then (so the next request can
find the node full). The async-stream methods therefore return a generator of ours around
theirs, which closes both, in order: theirs (it records the end of the LLM event), then ours
(it closes the zml stream).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["callback_stream"]

T = TypeVar("T")

Callback = Callable[[Callable[..., Any]], Callable[..., Any]]
"""A LlamaIndex callback decorator: ``llm_chat_callback()`` or ``llm_completion_callback()``."""


async def callback_stream(
    callback: Callback,
    llm: Any,
    first: Any,
    kwargs: dict[str, Any],
    open_stream: Callable[..., Awaitable[AsyncGenerator[T, None]]],
) -> AsyncGenerator[T, None]:
    """``await open_stream(first, **kwargs)`` inside ``callback``'s LLM event, as a stream that
    ``aclose()`` closes at once, with the stream it iterates.

    Args:
        callback: the decorator that records the event (and its tokens) on ``llm``.
        llm: the LLM whose callback manager and instrumentation see the event.
        first: the messages, or the prompt, as the decorator expects them.
        kwargs: the call's keyword arguments (the event's ``additional_kwargs``).
        open_stream: opens our stream; it runs inside the event, so its errors are recorded.
    """
    opened: list[AsyncGenerator[T, None]] = []

    async def open_in_event(_llm: Any, first: Any, **kwargs: Any) -> AsyncGenerator[T, None]:
        opened.append(await open_stream(first, **kwargs))
        return opened[0]

    events: AsyncGenerator[T, None] = await callback(open_in_event)(llm, first, **kwargs)
    return _closing(events, opened[0])


async def _closing(
    events: AsyncGenerator[T, None], inner: AsyncGenerator[Any, None]
) -> AsyncGenerator[T, None]:
    try:
        async for item in events:
            yield item
    finally:
        try:
            await events.aclose()
        finally:
            await inner.aclose()
