"""Routing metadata on the wire: ``x-zml-*`` response headers and the ``zml_routing`` object.

A client that speaks only the OpenAI API still learns where its request went, from headers
(readable before a stream's first chunk, e.g. ``with_raw_response`` in the openai SDKs) and
from ``zml_routing`` in the JSON body or in the final chunk of a stream, which has exactly the
shape of ``response.routing`` (:class:`zml.RoutingInfo`) as JSON.

=====================  ====================================================================
header                 value
=====================  ====================================================================
``x-zml-node-id``      the node that served the request
``x-zml-accelerator``  its accelerator family
``x-zml-policy``       the policy it ran under (absent for a request without a policy)
``x-zml-queue-depth``  requests waiting on that node at dispatch (``routing.queue_depth``)
``x-zml-attempts``     dispatches made, the serving one included (1 + failovers)
=====================  ====================================================================

Bodies are spliced, not rebuilt: the completion is serialised once (pydantic's serializer,
in Rust) and the routing object is appended before its closing brace.
"""

from __future__ import annotations

from urllib.parse import quote

from zml.types import RoutingInfo

__all__ = ["routing_headers", "routing_json", "with_routing"]

_ROUTING_SERIALIZER = RoutingInfo.__pydantic_serializer__


def _value(text: str) -> bytes:
    try:
        return text.encode("ascii")
    except UnicodeEncodeError:  # header values are ASCII on the wire: percent-encode the rest
        return quote(text, safe="").encode("ascii")


def routing_headers(routing: RoutingInfo) -> list[tuple[bytes, bytes]]:
    """The ``x-zml-*`` headers of a served request."""
    headers = [
        (b"x-zml-node-id", _value(routing.node_id)),
        (b"x-zml-accelerator", _value(routing.accelerator)),
        (b"x-zml-queue-depth", str(routing.queue_depth).encode()),
        (b"x-zml-attempts", str(len(routing.attempts) + 1).encode()),
    ]
    if routing.policy is not None:
        headers.append((b"x-zml-policy", _value(routing.policy)))
    return headers


def routing_json(routing: RoutingInfo) -> bytes:
    """``routing`` as JSON (the ``zml_routing`` object)."""
    return _ROUTING_SERIALIZER.to_json(routing)


def with_routing(obj: bytes, routing: bytes) -> bytes:
    """A JSON object's bytes with ``"zml_routing": routing`` added as its last member."""
    if obj.endswith(b"{}"):
        return obj[:-1] + b'"zml_routing":' + routing + b"}"
    return obj[:-1] + b',"zml_routing":' + routing + b"}"
