"""The prefix cache across restarts: a real `ferrum serve` on stories260K writes the blocks of a
reused prompt to disk, and the next process answers the same request from them (the same
greedy answer); a process killed while writing, or odd files in the cache folder, leave
nothing the next start trips on."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import httpx
import pytest

from ferrum_mac.backends.state.prefix_disk import SUFFIX

CHAT = "/v1/chat/completions"
# about 300 tokens: a prompt of several full KV blocks, within stories260K's 512 positions
STORY = " ".join(["Once upon a time, there was a little girl named Lily. She liked to play in the park."] * 14)
REQUEST = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 12, "temperature": 0}


class ServeProcess:
    """`ferrum serve` in its own process, with its cache folder and the disk tier on."""

    def __init__(self, model: Path, cache: Path, log: Path, backend: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        env = {**os.environ, "FERRUM_CACHE_DIR": str(cache), "FERRUM_PREFIX_DISK_MB": "64"}
        command = [
            sys.executable,
            "-m",
            "ferrum_mac.cli",
            "serve",
            str(model),
            "--port",
            str(port),
            "--backend",
            backend,
        ]
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=out, env=env)
        deadline = time.monotonic() + 60
        while "serving" not in log.read_text() and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "serving" in log.read_text(), log.read_text()

    def ask(self) -> tuple[str, int]:
        """The answer to REQUEST and the prompt tokens it took from the cache."""
        response = httpx.post(self.url + CHAT, json=REQUEST, timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"/metrics has no {name}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        assert "Traceback" not in self.log.read_text(), self.log.read_text()


def block_files(cache: Path) -> list[Path]:
    return sorted((cache / "prefix-cache").glob(f"*/*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)


def wait_for_files(cache: Path, timeout: float = 30) -> list[Path]:
    """The block files once their number stops changing (the writer thread has caught up)."""
    deadline, seen = time.monotonic() + timeout, -1
    while time.monotonic() < deadline:
        files = block_files(cache)
        if files and len(files) == seen:
            return files
        seen = len(files)
        time.sleep(0.3)
    raise AssertionError(f"no block files written under {cache}")


@pytest.fixture
def run_server(stories_path, tmp_path):
    started = []

    def start(cache: Path, backend: str = "auto") -> ServeProcess:
        server = ServeProcess(stories_path, cache, tmp_path / f"serve-{len(started)}.log", backend)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_a_restarted_server_answers_a_seen_prompt_from_disk(run_server, tmp_path, backend):
    cache = tmp_path / "cache"
    first = run_server(cache, backend)
    cold, cached = first.ask()
    assert cached == 0
    answer, cached = first.ask()  # reused in memory: now worth writing
    assert answer == cold and cached > 0
    wait_for_files(cache)
    written = first.metric("ferrum_prefix_disk_written_bytes_total")
    assert written == sum(p.stat().st_size for p in block_files(cache))
    first.stop()

    second = run_server(cache, backend)
    answer, cached = second.ask()
    assert answer == cold and cached >= len(block_files(cache)) * 32
    assert second.metric("ferrum_prefix_disk_read_bytes_total") == written
    assert second.metric("ferrum_prefix_disk_written_bytes_total") == 0  # a hit rewrites nothing
    second.stop()


@pytest.mark.slow
def test_a_server_killed_while_writing_leaves_no_file_the_next_start_trips_on(run_server, tmp_path):
    cache = tmp_path / "cache"
    first = run_server(cache)
    cold, _ = first.ask()
    first.ask()
    deadline = time.monotonic() + 30
    while not block_files(cache) and time.monotonic() < deadline:  # the writer has begun: kill it now
        time.sleep(0.001)
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=30)
    files = wait_for_files(cache)
    # what a kill during a write leaves: the writer's temporary file, and a block file whose
    # data did not all reach the disk (a rename is atomic, a disk losing power is not)
    torn = files[-1]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    temp = torn.parent / f".{'f' * 32}.{first.process.pid}.tmp"
    temp.write_bytes(b"half a block")

    second = run_server(cache)
    assert not temp.exists()  # swept at open
    answer, cached = second.ask()
    assert answer == cold
    assert not torn.exists()  # read as a miss and deleted
    assert cached <= 32 * (len(files) - 1)  # the torn block was not used
    second.stop()


def make_odd(files: list[Path]) -> None:
    """Every block file made one of the odd files a hostile trial left, in turn: a folder of its
    name, a header declaring a 32 TiB tensor, and a whole, valid block of another shape (one
    layer more; its checksums agree with its data)."""
    for i, path in enumerate(files):
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
        if i % 3 == 0:
            path.unlink()
            path.mkdir()
            continue
        entry, meta = header["kv"], header["__metadata__"]
        itemsize = len(data) // math.prod(entry["shape"])
        if i % 3 == 1:
            entry["shape"] = [1 << 16, 2, 1 << 13, 32, 1 << 8]
        else:
            entry["shape"] = [entry["shape"][0] + 1, *entry["shape"][1:]]
            data += data[: len(data) // (entry["shape"][0] - 1)]
            meta["sha256"], meta["crc32"] = hashlib.sha256(data).hexdigest(), str(zlib.crc32(data))
        entry["data_offsets"] = [0, math.prod(entry["shape"]) * itemsize]
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_odd_files_in_the_cache_folder_are_misses_over_http(run_server, tmp_path, backend):
    """Whichever odd file a restarted server reads first, the request is answered as if nothing
    were cached (no 500, no cache path in any answer), and so is the next."""
    cache = tmp_path / "cache"
    first = run_server(cache, backend)
    cold, _ = first.ask()
    first.ask()
    make_odd(wait_for_files(cache))
    first.stop()

    second = run_server(cache, backend)
    for _ in range(2):
        response = httpx.post(second.url + CHAT, json=REQUEST, timeout=60)
        assert response.status_code == 200 and str(cache) not in response.text, response.text
        assert response.json()["choices"][0]["message"]["content"] == cold
    second.stop()
