"""``zml serve`` as a command: it serves a config, and refuses a bad one with a clear message."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.conftest import MODEL, SimSetup

ROOT = Path(__file__).parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    out.update(extra)
    return out


def start_serve(config: Path, port: int, *extra: str,
                environ: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "zml", "serve", "--config", str(config), "--port", str(port),
         *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environ or env(), cwd=str(ROOT))


def wait_ready(proc: subprocess.Popen[str], url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"zml serve exited: {proc.communicate(timeout=10)[1]}")
        try:
            if httpx2.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("zml serve did not start")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def test_zml_serve_serves_the_config_with_several_workers(
        sim_fleet: Callable[..., SimSetup]) -> None:
    setup = sim_fleet([{"id": "gpu", "family": "H100", "max_concurrency": 4}],
                      {"p": {"accelerator_chain": ["H100"]}}, time_scale=0.05)
    setup.path.write_text(setup.path.read_text() + '\n[gateway]\ndefault_policy = "p"\n')
    port = free_port()
    proc = start_serve(setup.path, port, "--workers", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        for _ in range(4):
            r = httpx2.post(f"{url}/v1/chat/completions", timeout=30,
                            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-zml-policy"] == "p"
    finally:
        err = stop(proc)
    assert "with 2 workers" in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_zml_serve_stops_within_shutdown_timeout_s_with_a_stream_in_flight(
        sim_fleet: Callable[..., SimSetup], signum: int) -> None:
    """Told to stop, it waited for every connection to close: one long stream kept it
    running until killed (and a second Ctrl-C printed a traceback)."""
    setup = sim_fleet([{"id": "gpu", "family": "H100", "max_concurrency": 4}],
                      {"p": {"accelerator_chain": ["H100"]}}, time_scale=0.05)
    setup.path.write_text(setup.path.read_text()
                          + '\n[gateway]\ndefault_policy = "p"\nshutdown_timeout_s = 1\n')
    port = free_port()
    proc = start_serve(setup.path, port)
    lines: list[str] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(proc, url)
        started = threading.Event()

        def read_stream() -> None:
            body = {"model": MODEL, "stream": True, "max_tokens": 200_000, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "x"}]}
            with contextlib.suppress(httpx2.HTTPError), httpx2.stream(
                    "POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    started.set()
                    lines.append(line)

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()
        assert started.wait(30)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)  # a hang guard: the limit is 1 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (0, 130, -signum), err  # (uvicorn re-raises the signal)
    assert "Traceback" not in err, err
    reader.join(30)
    assert lines and "data: [DONE]" not in lines  # cut short, and the client can tell:
    assert '"code":"shutting_down"' in [x for x in lines if x][-1]  # an error event ends it


def test_zml_serve_refuses_a_bad_gateway_table_with_one_message(tmp_path: Path,
                                                                sim_fleet: Any) -> None:
    setup = sim_fleet([{"id": "gpu", "family": "H100", "max_concurrency": 1}])
    setup.path.write_text(setup.path.read_text() + '\n[gateway]\ndefault_polcy = "p"\n')
    result = subprocess.run(
        [sys.executable, "-m", "zml", "serve", "--config", str(setup.path), "--port",
         str(free_port())], capture_output=True, text=True, env=env(), timeout=60,
        check=False, cwd=str(ROOT))
    assert result.returncode == 2
    assert "default_polcy" in result.stderr and "default_policy" in result.stderr
    assert "Traceback" not in result.stderr


def test_zml_serve_without_a_config_says_how_to_give_one(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "zml", "serve"], capture_output=True,
                            text=True, env=env(), timeout=60, check=False, cwd=str(tmp_path))
    assert result.returncode == 2
    assert "--config" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("text", ["", "[accelerators.H100]\n"])
def test_zml_serve_refuses_a_config_without_nodes_as_policy_check_does(
        tmp_path: Path, text: str) -> None:
    """It started a gateway that refused every request, where `zml policy check` said the
    file was empty."""
    path = tmp_path / "zml.toml"
    path.write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "zml", "serve", "--config", str(path), "--port",
         str(free_port())], capture_output=True, text=True, env=env(), timeout=60,
        check=False, cwd=str(ROOT))
    assert result.returncode == 2, result.stderr
    assert "has no [[nodes]]" in result.stderr and "Traceback" not in result.stderr


def test_zml_serve_on_a_busy_port_is_one_message_and_serves_nothing(sim_fleet: Any) -> None:
    setup = sim_fleet([{"id": "gpu", "family": "H100", "max_concurrency": 1}])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "zml", "serve", "--config", str(setup.path), "--port",
             str(port)], capture_output=True, text=True, env=env(), timeout=60, check=False,
            cwd=str(ROOT))
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in result.stderr
    assert "serving" not in result.stderr and "Traceback" not in result.stderr


def test_zml_serve_on_port_0_says_the_port_it_got(sim_fleet: Any) -> None:
    setup = sim_fleet([{"id": "gpu", "family": "H100", "max_concurrency": 1}])
    proc = start_serve(setup.path, 0)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the socket is bound
        assert line.startswith(f"zml gateway: serving {setup.path} on http://127.0.0.1:")
        url = line.split(" on ", 1)[1].strip().removesuffix("/v1")
        assert not url.endswith(":0")
        wait_ready(proc, url)
    finally:
        stop(proc)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--host", "", "--host must be an address to listen on, got ''"),
    ("--host", "  ", "0.0.0.0 to listen on every interface on purpose"),
    ("--workers", str(4 * (os.cpu_count() or 1) + 1), "(4 per CPU of this machine)"),
])
def test_zml_serve_refuses_an_empty_host_and_a_fork_bomb_of_workers(
        sim_fleet: Any, flag: str, value: str, says: str) -> None:
    """An empty --host would listen on every interface (the Host check then does not apply);
    --workers 100000 would start that many processes."""
    setup = sim_fleet([{"id": "gpu", "family": "H100", "max_concurrency": 1}])
    result = subprocess.run(
        [sys.executable, "-m", "zml", "serve", "--config", str(setup.path), "--port", "0",
         flag, value], capture_output=True, text=True, env=env(), timeout=60, check=False,
        cwd=str(ROOT))
    assert result.returncode == 2, result.stderr
    assert says in result.stderr
    assert "serving" not in result.stderr and "Traceback" not in result.stderr
