"""A real Redis for the zml-redis tests: ``redis-server`` started on a free loopback port.

The session's server is started by the first test that needs it and stopped at the end.
Without the ``redis-server`` binary, it is installed with apt-get where we are root on a
Debian-like machine (:func:`tests.conftest.system_tool`); otherwise the tests FAIL (they are
not skipped): install it (Debian/Ubuntu ``apt-get install redis-server``, macOS ``brew install
redis``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from zml_redis.plugin import reset
from zml_redis.settings import Settings

from tests.conftest import system_tool

HERE = Path(__file__).parent
REPLICA = HERE / "_replica.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """A ``redis-server`` subprocess on 127.0.0.1 (no persistence), restartable on its port."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True,
                           socket_timeout=5)

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.client() as c:
                    c.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(
                        f"redis-server did not start on port {self.port}: {err}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # in case a test paused it
            proc.kill()
            proc.wait(10)
        if proc is not None and proc.stderr:
            proc.stderr.close()

    def pause(self) -> None:
        """SIGSTOP: Redis hangs (connections open, no answers)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def _binary() -> str:
    return system_tool(
        "redis-server", packages=["redis-server"], why="the zml-redis tests need a real Redis",
        how="Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's Redis, on a free loopback port."""
    server = RedisServer(_binary()).start()
    yield server
    server.stop()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own (to stop, pause and restart)."""
    server = RedisServer(_binary()).start()
    yield server
    reset()  # before the server goes: no outage to report
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_env(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Settings]:
    """ZML_REDIS_URL and a fresh prefix for clients built in the test; hubs closed after."""
    monkeypatch.setenv("ZML_REDIS_URL", redis_server.url)
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    settings = Settings.from_env()
    assert settings is not None
    yield settings
    reset()


@pytest.fixture(autouse=True)
def _no_hub_left() -> Iterator[None]:
    yield
    reset()


def replica_env(**extra: str) -> dict[str, str]:
    """The environment of a replica subprocess: this one's without ZML_*, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    env.update(extra)
    return env
