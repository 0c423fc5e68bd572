"""The reward sandbox: generated code gets no network, bounded time and memory, and a clean directory."""

from __future__ import annotations

import socket
import threading

from offpolicy.data.rewards import get_reward
from offpolicy.data.sandbox import run_python


def test_plain_code_runs():
    r = run_python("print(6 * 7)")
    assert r.returncode == 0 and r.stdout.strip() == "42"


def test_no_network_even_to_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    r = run_python(code)
    server.close()
    assert r.returncode != 0 and "connected" not in r.stdout
    assert "Network is unreachable" in r.stderr or "Connection refused" in r.stderr or "Errno" in r.stderr
    assert accepted == []
    # the host's network still works for us
    assert socket.gethostbyname("localhost")


def test_infinite_loop_is_stopped():
    r = run_python("while True: pass", timeout_s=1.0)
    assert r.returncode != 0


def test_memory_bomb_is_stopped():
    r = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert r.returncode != 0 and "allocated" not in r.stdout
    assert "MemoryError" in r.stderr


def test_environment_is_empty_and_cwd_is_private():
    r = run_python("import os\nprint(sorted(os.environ))\nprint(os.listdir('.'))")
    assert r.returncode == 0
    env, listing = r.stdout.splitlines()
    assert "HOME" not in env and "PYTHONPATH" not in env
    assert listing == "[]"


def test_python_tests_reward():
    reward = get_reward("python_tests")
    answer = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    assert reward("", answer, "```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    assert reward("", answer, "```python\ndef add(a, b):\n    return a - b\n```") == 0.0
    assert reward("", answer, "def add(a, b): return a + b") == 1.0
    assert reward("", answer, "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)") == 0.0
