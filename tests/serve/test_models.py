"""Several models behind one live server: stories260K (the default, opened at start) and the
bundled SmolLM2 (opened when a request names it) each answer with their own model's greedy
output; an idle model unloads after its keep-alive and its memory returns to the system (RSS,
measured); an unknown model is a 404 naming what exists; a model that does not fit unloads an
idle one first, else is refused naming who holds the memory; bad --keep-alive and OLLAMA_HOST
values are one-line errors."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_support import CHAT, MESSAGES, LiveServer, error_of, open_models

from ferrum_mac.errors import FerrumError
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.app import build_app
from ferrum_mac.serve.command import ServeOptionError, keep_alive_option, ollama_address, serving_line
from ferrum_mac.serve.batching.models import FOREVER, served_name

SMOLLM2 = "smollm2:135m"
STORIES = "stories260K"


def rss_mib() -> float:
    """This process's resident memory (Linux's /proc; the test skips elsewhere)."""
    pages = int(open("/proc/self/statm").read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def settled_rss(below: float, wait_s: float = 10) -> float:
    """RSS once it has dropped under `below` (the unload finishes after the registry drops the
    model from its list), or when `wait_s` has passed."""
    deadline = time.monotonic() + wait_s
    while (rss := rss_mib()) >= below and time.monotonic() < deadline:
        time.sleep(0.1)
    return rss


@pytest.fixture(scope="module")
def two(stories_path, smollm2_gguf):
    models = open_models(stories_path, STORIES, {SMOLLM2: smollm2_gguf}, kv_capacity=512, keep_alive_s=FOREVER)
    live = LiveServer(build_app(models))
    yield live, models
    live.stop()
    models.close()


def greedy(server, model: str, **extra) -> str:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, **extra}
    response = httpx.post(server.url + CHAT, json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == model
    return answer["choices"][0]["message"]["content"]


def loaded(models) -> list[str]:
    return sorted(m.name for m in models.loaded())


def test_each_model_answers_with_its_own_output(two, server):
    live, models = two
    stories_alone = greedy(server, STORIES)  # the session's server holds stories260K alone
    assert greedy(live, STORIES) == stories_alone
    smollm2 = greedy(live, SMOLLM2)  # opened now
    assert smollm2 != stories_alone and loaded(models) == [SMOLLM2, STORIES]
    with ThreadPoolExecutor(4) as pool:
        both = list(pool.map(lambda name: greedy(live, name), [STORIES, SMOLLM2, STORIES, STORIES]))
    assert both == [stories_alone, smollm2, stories_alone, stories_alone]
    listed = httpx.get(live.url + "/v1/models").json()["data"]
    assert {m["id"]: m["max_model_len"] for m in listed} == {STORIES: 512, SMOLLM2: 512}
    assert models.unload(STORIES) and loaded(models) == [SMOLLM2]
    assert greedy(live, SMOLLM2) == smollm2  # alone now
    assert greedy(live, STORIES) == stories_alone  # opened again


def test_ferrum_ps_lists_the_loaded_models_and_ferrum_stop_unloads_one(two, capsys):
    """`ferrum ps` and `ferrum stop` against a live server, as Ollama's ps and stop: what is
    loaded, with its size, processor, context and keep-alive; a model not loaded is one line."""
    from ferrum_mac.cli.server_commands import ps_command, stop_command

    live, models = two
    greedy(live, SMOLLM2)
    ps_command(live.url + "/v1", None)  # a client's base URL works as well as the root
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {STORIES, SMOLLM2}
    assert "CPU" in rows[SMOLLM2] and "512" in rows[SMOLLM2] and rows[SMOLLM2].endswith("forever")
    stop_command(SMOLLM2, live.url, None)
    assert capsys.readouterr().out == f"stopped {SMOLLM2}\n" and loaded(models) == [STORIES]
    with pytest.raises(FerrumError, match=f"^{SMOLLM2} is not loaded on .*loaded: {STORIES}"):
        stop_command(SMOLLM2, live.url, None)
    assert greedy(live, SMOLLM2)  # the next request loads it again


def test_ferrum_ps_without_a_server_is_one_line():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"127.0.0.1:{s.getsockname()[1]}"
    for command in (["ps"], ["stop", SMOLLM2]):
        result = subprocess.run(
            [sys.executable, "-m", "ferrum_mac.cli", *command, "--remote", url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr == f"ferrum: no server is running at http://{url} (check the URL)\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_an_idle_model_unloads_after_its_keep_alive_and_its_memory_returns(two, smollm2_gguf):
    live, models = two
    weights_mib = smollm2_gguf.stat().st_size / 2**20
    models.unload(SMOLLM2)
    before = rss_mib()
    greedy(live, SMOLLM2)  # loaded to stay, so a slow machine cannot unload it before it is weighed
    held = rss_mib()
    models.keep_alive_s = 1.0
    try:
        greedy(live, SMOLLM2)  # a request takes the server's keep-alive for its model
        deadline = time.monotonic() + 15
        while SMOLLM2 in loaded(models) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        models.keep_alive_s = FOREVER
    assert SMOLLM2 not in loaded(models)
    after = settled_rss(below=before + 0.3 * (held - before))
    print(f"RSS: {before:.0f} MiB idle, {held:.0f} MiB with SmolLM2 loaded, {after:.0f} MiB after it unloaded")
    assert held - before > weights_mib  # at least its weights (packed as in the file) are held
    assert after - before < 0.3 * (held - before)  # most of it back; what stays depends on the C heap
    ids = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
    assert SMOLLM2 in ids and httpx.get(live.url + "/health").json()["status"] == "ok"


def test_an_unknown_model_is_a_404_naming_the_models(two):
    live, _ = two
    body = {"model": "no-such-model:7b", "messages": MESSAGES, "max_tokens": 4}
    error = error_of(httpx.post(live.url + CHAT, json=body, timeout=30), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert STORIES in error["message"] and SMOLLM2 in error["message"]
    assert "--any-model answers any other name with stories260K" in error["message"]  # what a client can do
    bad_type = error_of(httpx.post(live.url + CHAT, json={**body, "model": 7}, timeout=30), 400)
    assert bad_type["param"] == "model"


def test_with_any_model_an_unknown_name_is_answered_by_the_default_model(stories_path, smollm2_gguf, two):
    models = open_models(stories_path, STORIES, {SMOLLM2: smollm2_gguf}, kv_capacity=512, any_name=True)
    live = LiveServer(build_app(models))
    try:
        assert greedy(live, STORIES) == greedy(two[0], STORIES)
        body = {"model": "gpt-4o", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(live.url + CHAT, json=body, timeout=120).json()
        assert answer["model"] == STORIES  # says which model answered
        assert answer["choices"][0]["message"]["content"] == greedy(live, STORIES)
        shown = httpx.post(live.url + "/api/show", json={"model": "llama3"}, timeout=60)
        assert shown.status_code == 200 and loaded(models) == [STORIES]  # the store's other model stays unloaded
    finally:
        live.stop()
        models.close()


def test_a_model_that_does_not_fit_unloads_an_idle_one_first_else_is_refused(stories_path, tmp_path):
    copy = shutil.copytree(stories_path, tmp_path / "stories-b")
    free = {"bytes": 0}
    models = open_models(
        stories_path,
        "a",
        {"b": copy},
        kv_capacity=64,
        free_memory=lambda: 0 if "a" in loaded(models) else free["bytes"],
    )
    try:
        free["bytes"] = 10**12
        b = asyncio.run(models.acquire("b"))  # "a" was idle: unloaded to make room
        assert loaded(models) == ["b"]
        free["bytes"] = 0
        with pytest.raises(api.ApiError) as busy:
            asyncio.run(models.acquire("a"))
        assert busy.value.status == 503 and "'b'" in busy.value.message
        models.release(b)
        with pytest.raises(api.ApiError) as never:
            asyncio.run(models.acquire("a"))  # "b" goes, and still nothing is free
        assert never.value.status == 507 and loaded(models) == []
    finally:
        models.close()


@pytest.mark.parametrize("text, seconds", [("5m", 300.0), ("300", 300.0), ("0", 0.0), ("-1", FOREVER), ("1h", 3600.0)])
def test_keep_alive_takes_ollamas_forms(text, seconds):
    assert keep_alive_option(text) == seconds


@pytest.mark.parametrize("text", ["5x", "", "forever", "1e999"])
def test_a_bad_keep_alive_is_refused(text):
    with pytest.raises(ServeOptionError, match="--keep-alive"):
        keep_alive_option(text)


@pytest.mark.parametrize(
    "value, address",
    [
        (None, ("127.0.0.1", 11434)),
        ("0.0.0.0", ("0.0.0.0", 11434)),
        ("localhost:9000", ("localhost", 9000)),
        ("http://[::1]:8080", ("::1", 8080)),
        (":4000", ("127.0.0.1", 4000)),
    ],
)
def test_ollama_host_forms(value, address):
    assert ollama_address(value) == address


def test_the_serving_line_names_the_url_each_client_takes():
    openai = serving_line("smollm2:135m", "127.0.0.1", 8000, 8192, ollama=False)
    assert "http://127.0.0.1:8000/v1 (context 8192 tokens)" in openai
    ollama = serving_line("smollm2:135m", "127.0.0.1", 11434, 8192, ollama=True)
    assert "http://127.0.0.1:11434 for Ollama's clients, http://127.0.0.1:11434/v1 for OpenAI's" in ollama


@pytest.mark.parametrize("value", ["host:99999", "ftp://host:1", "host:port", "http://host:1/path"])
def test_a_bad_ollama_host_is_refused(value):
    with pytest.raises(ServeOptionError, match="OLLAMA_HOST"):
        ollama_address(value)


def test_ferrum_serve_refuses_a_bad_keep_alive_in_one_line(stories_path):
    result = subprocess.run(
        [sys.executable, "-m", "ferrum_mac.cli", "serve", str(stories_path), "--keep-alive", "soon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and result.stderr.count("\n") == 1 and "--keep-alive" in result.stderr


def test_a_model_served_from_a_folder_is_named_by_the_folders_name(stories_path):
    from ferrum_mac.serve.command import open_models as serve_models

    models = serve_models(str(stories_path), "auto", None, 64, FOREVER)
    try:
        assert models.default_name == STORIES
        live = LiveServer(build_app(models))
        try:
            assert greedy(live, STORIES)
            assert [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]][0] == STORIES
            assert [m["name"] for m in httpx.get(live.url + "/api/ps").json()["models"]] == [STORIES]
            assert httpx.get(live.url + "/health").json()["model"] == STORIES
        finally:
            live.stop()
    finally:
        models.close()


def test_ferrum_serve_of_a_folder_says_its_name_and_its_path(stories_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ferrum_mac.cli", "serve", str(stories_path), "--port", str(port)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        assert line.startswith(f"ferrum: serving {STORIES} (from {stories_path}) on http://127.0.0.1:{port}/v1")
    finally:
        process.kill()
        process.wait()


def test_served_names_of_files_aliases_and_folders(stories_path, smollm2_gguf, tmp_path):
    assert served_name(str(smollm2_gguf)) == smollm2_gguf.stem
    assert served_name(SMOLLM2) == SMOLLM2 and served_name("org/name") == "org/name"
    assert served_name(str(stories_path) + "/") == STORIES


def test_requests_that_arrive_while_a_model_loads_wait_for_that_one_load(stories_path, tmp_path):
    copy = shutil.copytree(stories_path, tmp_path / "stories-c")
    models = open_models(stories_path, "a", {"c": copy}, kv_capacity=64)
    opened = []
    open_scheduler = models.opener
    models.opener = lambda path: opened.append(path) or open_scheduler(path)

    async def three():
        return await asyncio.gather(*(models.acquire("c") for _ in range(3)))

    try:
        first, second, third = asyncio.run(three())
        assert first is second is third and first.active == 3 and opened == [copy]
    finally:
        models.close()


def test_loading_again_after_an_unload_reuses_the_schedulers_thread(stories_path, tmp_path):
    import threading

    copy = shutil.copytree(stories_path, tmp_path / "stories-d")
    models = open_models(stories_path, "a", {"d": copy}, kv_capacity=64)

    def threads() -> int:
        time.sleep(0.05)  # a stopped scheduler's thread puts itself back just after it says so
        return sum(t.name == "ferrum-scheduler" for t in threading.enumerate())

    try:
        counts = []
        for _ in range(3):
            models.release(asyncio.run(models.acquire("d")))
            assert models.unload("d")
            counts.append(threads())
        assert counts[0] == counts[1] == counts[2]
    finally:
        models.close()
