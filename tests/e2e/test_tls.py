"""An https node, for real: zml's own connection pools over TLS (the TLS context they build
the first time an ``https`` node is used, and the request held until the response is read).

The node is a simulated one behind a TLS-terminating relay on loopback; the relay's
certificate is made for 127.0.0.1 by ``openssl`` and trusted through ``SSL_CERT_FILE``, which
httpx2's default TLS context reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zml
from tests.conftest import MODEL, render_config, system_tool
from tests.e2e.conftest import settled

NODES = [{"id": "tls-a", "family": "H100", "max_concurrency": 4}]
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    openssl = system_tool("openssl", packages=["openssl"], why="the TLS tests make a certificate",
                          how="apt-get install openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@contextlib.contextmanager
def tls_relay(target_port: int, cert: Path, key: Path) -> Iterator[int]:
    """A TLS server on loopback that relays each connection's bytes to ``target_port``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    loop = asyncio.new_event_loop()
    started: list[asyncio.Server] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def start() -> None:
        started.append(await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context))

    loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield started[0].sockets[0].getsockname()[1]
    finally:
        async def stop() -> None:
            started[0].close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def https_config(sim_fleet: Any, certificate: tuple[Path, Path], tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Any]]:
    setup = sim_fleet(NODES, time_scale=0.01)
    port = int(setup.fleet.url("tls-a").rsplit(":", 1)[1])
    monkeypatch.setenv("SSL_CERT_FILE", str(certificate[0]))
    with tls_relay(port, *certificate) as tls_port:
        nodes = [{**NODES[0], "url": f"https://127.0.0.1:{tls_port}", "models": [MODEL]}]
        path = tmp_path / "https.toml"
        path.write_text(render_config({"H100": {}}, nodes, None))
        yield path, setup


async def test_the_async_client_answers_and_streams_from_an_https_node(
    https_config: tuple[Path, Any]
) -> None:
    path, setup = https_config
    async with zml.AsyncClient(config=path, probe_interval_s=None) as client:
        for _ in range(3):
            answer = await client.infer(MODEL, MSGS, max_tokens=4)
            assert answer.choices[0].message.content
            assert answer.routing.node_id == "tls-a"
        big = [{"role": "user", "content": "x" * 200_000}]  # more than a held write
        assert (await client.infer(MODEL, big, max_tokens=2)).choices[0].message.content
        chunks = [c async for c in client.infer_stream(MODEL, MSGS, max_tokens=4)]
        assert len(chunks) >= 4
    assert settled(setup.node("tls-a")).completed_total == 5


def test_the_sync_client_answers_and_streams_from_an_https_node(
    https_config: tuple[Path, Any]
) -> None:
    path, setup = https_config
    with zml.Client(config=path, probe_interval_s=None) as client:
        for _ in range(3):
            assert client.infer(MODEL, MSGS, max_tokens=4).choices[0].message.content
        assert len(list(client.infer_stream(MODEL, MSGS, max_tokens=4))) >= 4
    assert settled(setup.node("tls-a")).completed_total == 4


def test_a_node_whose_certificate_is_not_trusted_fails_as_a_connection_error(
    https_config: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, setup = https_config
    monkeypatch.delenv("SSL_CERT_FILE")
    with zml.Client(config=path, probe_interval_s=None) as client, \
            pytest.raises(zml.RoutingError) as caught:
        client.infer(MODEL, MSGS, max_tokens=4)
    attempts = caught.value.routing_context["attempts"]
    assert [a["error"] for a in attempts] == ["connection_error"]
    assert "CERTIFICATE_VERIFY_FAILED" in attempts[0]["message"]
    assert setup.node("tls-a").stats.completed_total == 0
