"""ZML as LlamaIndex's global LLM: queries over a small in-memory VectorStoreIndex (built with
MockEmbedding) answered through zml, with the routing of every LLM call."""

from __future__ import annotations

from collections.abc import Callable

from llama_index.core import Document, MockEmbedding, Settings, VectorStoreIndex
from llama_index.core.base.response.schema import StreamingResponse
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload, LlamaDebugHandler

from llama_index.llms.zml import ZML

POLICY = "llama3-production"  # as in conftest.py

DOCS = [
    Document(text="The fleet has H100 nodes in two racks, each with eight slots."),
    Document(text="MI300X nodes serve the overflow when the H100 family is saturated."),
    Document(text="The llama3-production policy tries H100 first, then MI300X."),
]
QUESTION = "Which accelerator family serves the overflow?"


def llm_routes(debug: LlamaDebugHandler) -> list[dict]:
    """The zml routing record of every LLM call the callback manager saw end."""
    ends = debug.get_event_pairs(CBEventType.LLM)
    return [pair[1].payload[EventPayload.RESPONSE].additional_kwargs["zml_routing"]
            for pair in ends]


def use_zml(llm: ZML) -> LlamaDebugHandler:
    debug = LlamaDebugHandler()
    Settings.callback_manager = CallbackManager([debug])
    Settings.llm = llm
    Settings.embed_model = MockEmbedding(embed_dim=8)
    return debug


def test_query_engine(make_llm: Callable[..., ZML]) -> None:
    debug = use_zml(make_llm())
    index = VectorStoreIndex.from_documents(DOCS)
    response = index.as_query_engine(similarity_top_k=2).query(QUESTION)
    assert str(response)
    assert len(response.source_nodes) == 2
    routes = llm_routes(debug)
    assert routes
    assert all(r["policy"] == POLICY and r["accelerator"] in {"H100", "MI300X"} for r in routes)


def test_streaming_query_engine(make_llm: Callable[..., ZML]) -> None:
    debug = use_zml(make_llm())
    index = VectorStoreIndex.from_documents(DOCS)
    response = index.as_query_engine(streaming=True).query(QUESTION)
    assert isinstance(response, StreamingResponse)
    assert "".join(response.response_gen)
    assert [r["policy"] for r in llm_routes(debug)] == [POLICY]


async def test_async_query_engine(allm: ZML) -> None:
    debug = use_zml(allm)
    index = VectorStoreIndex.from_documents(DOCS)
    response = await index.as_query_engine().aquery(QUESTION)
    assert str(response)
    assert [r["policy"] for r in llm_routes(debug)] == [POLICY]
