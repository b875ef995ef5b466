"""LangChain on a zml fleet: a prompt template piped into ``ChatZML`` under a named policy.

Every call the chain makes is routed by zml under the ``llama3-production`` policy, and each
answer says where it went (``message.response_metadata["zml_routing"]``); a streamed answer
carries it, with the token usage, on its last chunk.

Run it against any zml.toml whose nodes serve the model::

    python examples/langchain_chat.py path/to/zml.toml
    ZML_CONFIG=path/to/zml.toml python examples/langchain_chat.py
    python examples/langchain_chat.py --sim   # first start simulated nodes on loopback

``ZML_MODEL`` and ``ZML_POLICY`` override the model and the policy. ``--sim``
serves one H100 node with a single slot and two MI300X nodes, so the batch of
questions shows the policy moving on to MI300X once H100 is full.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable

import zml
from langchain_zml import ChatZML

MODEL = os.environ.get("ZML_MODEL", "meta-llama/llama-3-8b-instruct")
POLICY = os.environ.get("ZML_POLICY", "llama3-production")

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "You answer questions about {topic} in two sentences."),
        ("human", "{question}"),
    ]
)
QUESTIONS = [
    "Why route requests by accelerator family?",
    "What does a routing policy decide?",
    "When does a request move to the next family?",
]


def build_chain(llm: ChatZML) -> Runnable[dict[str, Any], BaseMessage]:
    """The prompt piped into the chat model."""
    return PROMPT | llm


def describe(message: BaseMessage) -> str:
    """One line: which node served the message, under which policy, at what cost in tokens."""
    route = message.response_metadata["zml_routing"]
    usage = getattr(message, "usage_metadata", None) or {}
    return (
        f"served by {route['node_id']} ({route['accelerator']}) under policy "
        f"{route['policy']}, queue depth {route['queue_depth']}, "
        f"{usage.get('total_tokens', '?')} tokens"
    )


def run(config: str | None) -> int:
    llm = ChatZML(model=MODEL, policy=POLICY, config=config, max_tokens=96)
    chain = build_chain(llm)
    topic = "inference fleets"
    try:
        answer = chain.invoke({"topic": topic, "question": QUESTIONS[0]})
        print(f"answer: {answer.content}")
        print(f"invoke: {describe(answer)}")

        full: Any = None
        print("stream: ", end="")
        for chunk in chain.stream({"topic": topic, "question": QUESTIONS[1]}):
            print(chunk.content, end="", flush=True)
            full = chunk if full is None else full + chunk
        print()
        print(f"stream: {describe(full)}")

        batch = chain.batch([{"topic": topic, "question": q} for q in QUESTIONS])
        for message in batch:
            print(f"batch: {describe(message)}")
    except zml.RoutingError as exc:
        # No node could take a request: the context says which families were tried and why.
        print(f"zml could not route the request: {exc.routing_context}", file=sys.stderr)
        return 1
    finally:
        llm.close()
    return 0


@contextmanager
def simulated_fleet() -> Iterator[str]:
    """Serve simulated nodes on free loopback ports; yield the path of their zml.toml."""
    from zml.sim import SimFleet, SimNodeSpec

    specs = [
        SimNodeSpec(id="h100-1", family="H100", models=(MODEL,), max_concurrency=1),
        SimNodeSpec(id="mi300x-1", family="MI300X", models=(MODEL,), max_concurrency=4),
        SimNodeSpec(id="mi300x-2", family="MI300X", models=(MODEL,), max_concurrency=4),
    ]
    with SimFleet(specs, time_scale=0.2) as fleet, tempfile.TemporaryDirectory() as tmp:
        lines = ["[accelerators.H100]", "[accelerators.MI300X]", ""]
        for spec in specs:
            lines += [
                "[[nodes]]",
                f'id = "{spec.id}"',
                f'family = "{spec.family}"',
                f'url = "{fleet.url(spec.id)}"',
                f'models = ["{MODEL}"]',
                f"max_concurrency = {spec.max_concurrency}",
                "",
            ]
        lines += [f"[policies.{POLICY}]", 'accelerator_chain = ["H100", "MI300X"]']
        path = Path(tmp) / "zml.toml"
        path.write_text("\n".join(lines) + "\n")
        yield str(path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "config", nargs="?", help="the zml.toml (default: $ZML_CONFIG, else ./zml.toml)"
    )
    parser.add_argument(
        "--sim", action="store_true", help="start simulated nodes on loopback and use them"
    )
    args = parser.parse_args(argv)
    if args.sim:
        with simulated_fleet() as config:
            return run(config)
    return run(args.config or os.environ.get("ZML_CONFIG"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
