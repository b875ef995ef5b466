"""LlamaIndex on a zml fleet: ``Settings.llm = ZML(...)``, then a query over a small index.

Every LLM call the query engine makes is routed by zml under a named policy, and each
response says where it went (``response.additional_kwargs["zml_routing"]``). Here an
instrumentation handler collects those records and prints them after the answer.

Run it against any zml.toml whose nodes serve the model::

    python examples/llamaindex_settings.py path/to/zml.toml
    ZML_CONFIG=path/to/zml.toml python examples/llamaindex_settings.py

``ZML_MODEL`` and ``ZML_POLICY`` override the model and the policy. Embeddings are not zml's
business (it routes chat completions): the example uses LlamaIndex's ``MockEmbedding`` so it
runs offline; put your embedding model there.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from llama_index.core import Document, MockEmbedding, Settings, VectorStoreIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from pydantic import Field

import zml
from llama_index.llms.zml import ZML

MODEL = os.environ.get("ZML_MODEL", "meta-llama/llama-3-8b-instruct")
POLICY = os.environ.get("ZML_POLICY", "llama3-production")

DOCUMENTS = [
    "Our fleet has H100 nodes for interactive traffic and MI300X nodes for overflow.",
    "The llama3-production policy tries H100 first and moves to MI300X near capacity.",
    "Routing happens in the client process: no proxy sits between the app and the nodes.",
]


class RoutingLog(BaseEventHandler):
    """Keeps the zml routing record of every LLM chat call that ends."""

    routes: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "RoutingLog"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            routing = event.response.additional_kwargs.get("zml_routing")
            if routing is not None:
                self.routes.append(routing)


def main(argv: list[str]) -> int:
    config = argv[1] if len(argv) > 1 else os.environ.get("ZML_CONFIG")
    Settings.llm = ZML(model=MODEL, policy=POLICY, config=config)
    Settings.embed_model = MockEmbedding(embed_dim=64)

    log = RoutingLog()
    get_dispatcher().add_event_handler(log)

    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCUMENTS])
    query_engine = index.as_query_engine(similarity_top_k=2)
    try:
        answer = query_engine.query("Which accelerator families serve our traffic?")
    except zml.RoutingError as exc:
        # No node could take the request: the context says which families were tried and why.
        print(f"zml could not route the query: {exc.routing_context}", file=sys.stderr)
        return 1

    print(f"answer: {answer}")
    for r in log.routes:
        print(
            f"routed to {r['node_id']} ({r['accelerator']}) by policy {r['policy']}: "
            f"queue depth {r['queue_depth']}, predicted TTFT {r['predicted_ttft_ms']:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
