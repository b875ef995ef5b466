"""Fuzzing the public API: whatever a caller passes, zml fails only with a ``zml.ZMLError``.

Hypothesis generates calls of ``infer``, ``infer_stream`` (sync and async), ``Policy``,
``Client`` and ``Timeouts`` with hostile values (NaN and infinities, lone surrogates, bytes,
sets, unhashable roles, odd keys, nested junk) against one ``httpx2.MockTransport`` node that
answers everything correctly and records every body it receives. Every exception must be a
``zml.ZMLError``, and no body on the wire may hold a ``NaN`` or ``Infinity`` token.

Seeded and bounded (``derandomize=True``, a fixed ``max_examples`` per test: 10,500 calls in
the tests that must pass). :func:`test_fuzz_inputs_that_need_core_wiring` covers the inputs
whose checks exist in ``zml.validation`` but are not yet called by dispatch; it is a strict
xfail until they are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import zml
from zml.dispatch import OPENAI_PARAMS

MODEL = "m"
CONFIG = f"""
[accelerators.H100]
[accelerators.MI300X]

[[nodes]]
id = "h100-a"
family = "H100"
url = "http://h100-a:8000"
models = ["{MODEL}"]
max_concurrency = 64

[[nodes]]
id = "mi-a"
family = "MI300X"
url = "http://mi-a:8000"
models = ["{MODEL}"]
max_concurrency = 64

[policies.prod]
accelerator_chain = ["H100", "MI300X"]
"""


def _fuzz(n: int, *, shrink: bool = True) -> Callable[[Any], Any]:
    phases = list(Phase) if shrink else [Phase.explicit, Phase.generate]
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    phases=phases,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


# --- the node ---------------------------------------------------------------------------------


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"a request body on the wire contains {name}")


class Node:
    """Answers every request correctly; checks each body is strict JSON."""

    def __init__(self) -> None:
        self.bodies = 0

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content, parse_constant=_refuse_constant)
        self.bodies += 1
        if body.get("stream"):
            events = [
                {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
                {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            ]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx2.Response(200, text=text,
                                   headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return path


@contextmanager
def client(config: Path, node: Node) -> Iterator[zml.Client]:
    http = httpx2.Client(transport=httpx2.MockTransport(node.handler))
    with zml.Client(api_key="sk-fuzz", config=config, http_client=http) as c:
        yield c
        assert c.fleet.in_flight == 0
    http.close()


def _only_zml_errors(call: Callable[[], object]) -> None:
    with suppress(zml.ZMLError):
        call()


# --- strategies -------------------------------------------------------------------------------

text = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\n", "é", "", " ", "\U0001f600"]),
)
numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True,
                                                            allow_infinity=True))
scalars = st.one_of(
    st.none(), st.booleans(), numbers, text, st.binary(max_size=4),
    st.sets(st.integers(0, 3), max_size=2), st.frozensets(text, max_size=2),
    st.complex_numbers(max_magnitude=2, allow_nan=False), st.builds(object),
)
keys = st.one_of(text, st.integers(-3, 3), st.tuples(st.integers(0, 2)), st.none(),
                 st.floats(allow_nan=False))
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner),
                            st.dictionaries(keys, inner, max_size=3)),
    max_leaves=4,
)
hashable_roles = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]),
                           text, st.none(), st.integers(), st.floats(allow_nan=False))
any_roles = st.one_of(hashable_roles, junk)
contents = st.one_of(text, st.none(), junk,
                     st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                              max_size=2))


good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                      "content": st.text(max_size=8)})


def messages(roles: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    message = st.one_of(
        good_message,
        st.fixed_dictionaries({"role": roles, "content": contents}),
        st.fixed_dictionaries({"role": roles, "content": contents},
                              optional={"name": junk, "tool_calls": junk}),
        junk,
    )
    # half of the calls get well-formed messages, so that the rest of the call is exercised
    return st.one_of(st.lists(good_message, min_size=1, max_size=2),
                     st.one_of(st.lists(message, max_size=3), st.tuples(message), junk))


param_names = st.sampled_from(
    [*sorted(OPENAI_PARAMS - {"stream_options"}), "temprature", "stream", "max_token"])
plausible = st.one_of(st.floats(0, 2), st.integers(1, 64), st.text(max_size=4),
                      st.lists(st.text(max_size=3), max_size=2), st.booleans())
params = st.dictionaries(param_names, st.one_of(plausible, junk), max_size=3)
policy_fields = st.sampled_from([*sorted(zml.Policy.model_fields), "fallback", "latency"])
families = st.sampled_from(["H100", "MI300X", "TPU", "h100"])
policy_values = st.one_of(junk, st.lists(families, max_size=3), st.sampled_from(
    ["latency", "balanced", "cost", "p"]), st.floats(0, 2000))
policy_dicts = st.dictionaries(policy_fields, policy_values, max_size=4)
str_policy_refs = st.one_of(st.none(), st.just("prod"), text, policy_dicts)
good_timeouts = st.one_of(
    st.just(zml.NOT_GIVEN), st.none(), st.floats(0.5, 30), st.integers(1, 30),
    st.builds(zml.Timeouts, total=st.one_of(st.none(), st.floats(0.5, 30))),
    st.one_of(text, st.lists(st.integers(), max_size=1), st.booleans(), st.floats(-5, 0),
              st.integers(-5, 0)),
)
accelerators = st.one_of(st.none(), families, text)
models = st.one_of(st.just(MODEL), st.just(MODEL), st.just(MODEL), text, junk)


@st.composite
def calls(draw: st.DrawFn, roles: st.SearchStrategy[Any] = hashable_roles,
          accel: st.SearchStrategy[Any] = accelerators,
          policies: st.SearchStrategy[Any] = str_policy_refs,
          timeouts: st.SearchStrategy[Any] = good_timeouts,
          extra: st.SearchStrategy[dict[str, Any]] = params) -> dict[str, Any]:
    kwargs: dict[str, Any] = draw(extra) if draw(st.booleans()) else {}
    kwargs.update(model=draw(models), messages=draw(messages(roles)))
    choice = draw(st.integers(0, 3))
    if choice == 0:
        kwargs["policy"] = draw(policies)
    elif choice == 1:
        kwargs["accelerator"] = draw(accel)
    if draw(st.integers(0, 2)) == 0:
        kwargs["timeout"] = draw(timeouts)
    if draw(st.integers(0, 4)) == 0:
        kwargs["metadata"] = draw(junk)
    return kwargs


# --- the fuzz tests ---------------------------------------------------------------------------


def test_fuzz_infer(config: Path) -> None:
    node = Node()
    with client(config, node) as c:

        @_fuzz(3000)
        @given(calls())
        def run(kwargs: dict[str, Any]) -> None:
            _only_zml_errors(lambda: c.infer(**kwargs))

        run()
    assert node.bodies > 200  # a good share of the generated calls was valid and sent


def test_fuzz_infer_stream(config: Path) -> None:
    node = Node()
    with client(config, node) as c:

        @_fuzz(2500)
        @given(calls())
        def run(kwargs: dict[str, Any]) -> None:
            def consume() -> None:
                with c.infer_stream(**kwargs) as stream:
                    for _ in stream:
                        pass

            _only_zml_errors(consume)

        run()
    assert node.bodies > 200


def test_fuzz_async_infer_and_stream(config: Path) -> None:
    node = Node()

    @_fuzz(500)
    @given(calls(), st.booleans())
    def run(kwargs: dict[str, Any], stream: bool) -> None:
        async def main() -> None:
            http = httpx2.AsyncClient(transport=httpx2.MockTransport(node.handler))
            async with zml.AsyncClient(api_key="sk-fuzz", config=config, http_client=http,
                                       probe_interval_s=None) as ac:
                try:
                    if stream:
                        async for _ in ac.infer_stream(**kwargs):
                            pass
                    else:
                        await ac.infer(**kwargs)
                except zml.ZMLError:
                    pass
                assert ac.fleet.in_flight == 0
            await http.aclose()

        asyncio.run(main())

    run()


def test_fuzz_policy(config: Path) -> None:
    zml.Client(config=config).close()  # activates the registry Policy validates against

    @_fuzz(2500)
    @given(policy_dicts)
    def run(fields: dict[str, Any]) -> None:
        _only_zml_errors(lambda: zml.Policy(**fields))

    run()


def test_fuzz_client_and_timeouts(config: Path) -> None:
    @_fuzz(1000)
    @given(st.one_of(st.none(), text, junk), good_timeouts, st.one_of(st.integers(-2, 5), junk))
    def run(api_key: Any, timeout: Any, max_attempts: Any) -> None:
        def build() -> None:
            if isinstance(timeout, zml.NotGiven):
                zml.Client(api_key=api_key, config=config, max_attempts=max_attempts).close()
            else:
                zml.Client(api_key=api_key, config=config, timeout=timeout,
                           max_attempts=max_attempts).close()

        _only_zml_errors(build)

    run()

    @_fuzz(1000)
    @given(st.one_of(junk, good_timeouts))
    def of(value: Any) -> None:
        _only_zml_errors(lambda: zml.Timeouts.of(value))

    of()


# --- what needs core wiring -------------------------------------------------------------------

timeout_fields = st.one_of(st.none(), numbers, junk)


class _Fields:
    """Fields for a zml.Timeouts, built inside the call (building it may raise)."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields


def test_fuzz_timeouts_refuse_bad_fields() -> None:
    @_fuzz(500, shrink=False)
    @given(timeout_fields, timeout_fields, timeout_fields, timeout_fields)
    def run(total: Any, connect: Any, first_token: Any, idle: Any) -> None:
        fields = {"total": total, "connect": connect, "first_token": first_token, "idle": idle}
        bad = [k for k, v in fields.items()
               if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                                     or not 0 < v < float("inf"))]
        if bad:
            with pytest.raises(zml.InvalidRequestError):
                zml.Timeouts(**fields)
        for value in (float("nan"), float("inf")):
            with pytest.raises(zml.InvalidRequestError):
                zml.Timeouts.of(value)

    run()


def test_fuzz_inputs_that_need_core_wiring(config: Path) -> None:
    node = Node()
    with client(config, node) as c:
        policies = st.one_of(str_policy_refs, st.dictionaries(keys, junk, max_size=3))
        timeouts = st.one_of(good_timeouts, numbers,
                             st.builds(_Fields, total=timeout_fields,
                                       connect=timeout_fields, idle=timeout_fields))
        extra = st.dictionaries(st.sampled_from(sorted(OPENAI_PARAMS)), junk, max_size=3)

        @_fuzz(1000, shrink=False)
        @given(calls(roles=any_roles, accel=st.one_of(accelerators, junk), policies=policies,
                     timeouts=timeouts, extra=extra), st.booleans())
        def run(kwargs: dict[str, Any], stream: bool) -> None:
            def call() -> None:
                if isinstance(kwargs.get("timeout"), _Fields):
                    kwargs["timeout"] = zml.Timeouts(**kwargs["timeout"].fields)
                if stream:
                    with c.infer_stream(**kwargs) as s:
                        for _ in s:
                            pass
                else:
                    c.infer(**kwargs)

            _only_zml_errors(call)

        run()
