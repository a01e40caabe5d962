"""The store over HTTP, through the fake Hub: /api/delete refuses a model this server runs or
another server has loaded, whatever spelling names it; listing, showing and /health survive
files deleted underneath (a clean 410 and a warning, never a 500); a path gets the same 404
as any unknown name, and no answer shows the server's folders."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from serve_support import API_KEY, MESSAGES, REPO, LiveServer, open_stories

STORIES = "stories260K"


@pytest.fixture
def pulled(hub) -> Path:
    """REPO pulled from the fake Hub into the test's own store: its snapshot folder."""
    from ferrum_mac.store import PullProgress, pull_model

    return pull_model(REPO, "mlx", PullProgress())


@contextmanager
def live_store(default: Path, name: str):
    """A live server of `default` (as `name`) and the store's models, as `ferrum serve` builds it."""
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app
    from ferrum_mac.serve.batching.models import LoadedModel, Models, size_of
    from ferrum_mac.serve.command import stored_path
    from ferrum_mac.store import list_models

    def open_scheduler(path):
        return Scheduler(open_stories(Path(path), kv_capacity=64), max_batch=2).start()

    first = LoadedModel(name, open_scheduler(default), size_of(default), 300.0, default)
    models = Models(first, open_scheduler, list_models, resolve=lambda n: stored_path(n, "auto"))
    live = LiveServer(build_app(models))
    live.models = models
    try:
        yield live
    finally:
        live.stop()
        models.close()


def delete(live, model: str) -> httpx.Response:
    return httpx.request("DELETE", live.url + "/api/delete", json={"model": model}, timeout=60)


def chat(live, model: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "stream": False, "options": {"num_predict": 3}, **extra}
    return httpx.post(live.url + "/api/chat", json=body, timeout=120)


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_the_served_model_is_not_deleted_by_another_spelling(pulled):
    commit = pulled.name
    with live_store(pulled, REPO) as live:
        for spelling in (REPO.upper(), f"{REPO}@main", f"{REPO}@{commit}", f" {REPO}:latest"):
            response = delete(live, spelling)
            assert response.status_code in (400, 404), response.text
            if response.status_code == 400:
                assert "started with" in response.json()["error"]
        assert pulled.is_dir() and (pulled / "model.safetensors").is_file()
        assert chat(live, REPO).status_code == 200


def test_a_model_another_server_has_loaded_is_not_deleted(pulled, stories_path):
    with live_store(stories_path, STORIES) as holder, live_store(stories_path, STORIES) as other:
        assert chat(holder, REPO, keep_alive="1h").status_code == 200
        assert "loaded by a running ferrum serve" in error_of(delete(other, f"{REPO}@main"), 409)
        assert pulled.is_dir() and chat(holder, REPO).status_code == 200

        unloaded = httpx.post(holder.url + "/api/generate", json={"model": REPO, "keep_alive": 0}, timeout=60)
        assert unloaded.json()["done_reason"] == "unload"
        assert delete(other, REPO).status_code == 200 and not pulled.exists()
        assert "not found" in error_of(chat(holder, REPO), 404)


def test_a_model_with_a_request_running_is_not_deleted(pulled, stories_path):
    import asyncio

    with live_store(stories_path, STORIES) as live:
        running = asyncio.run(live.models.acquire(REPO))  # a request on it, not finished
        try:
            assert "a request is running" in error_of(delete(live, REPO), 409)
            assert pulled.is_dir()
        finally:
            live.models.release(running)
        assert delete(live, REPO).status_code == 200 and not pulled.exists()


def test_ferrum_rm_refuses_a_model_a_server_holds(pulled):
    from ferrum_mac.store import in_use, plan_removal

    hold = in_use.hold(pulled)
    try:
        with pytest.raises(in_use.ModelInUseError, match="loaded by a running ferrum serve"):
            plan_removal(REPO).execute()
        assert pulled.is_dir()
    finally:
        hold.release()
    plan_removal(REPO).execute()
    assert not pulled.exists()


def test_files_deleted_underneath_are_a_clean_410_and_a_health_warning(pulled):
    from ferrum_mac.store import hub_cache

    with live_store(pulled, REPO) as live:
        shutil.rmtree(hub_cache.repo_dir(REPO))  # by hand, not through ferrum

        tags = httpx.get(live.url + "/api/tags", timeout=60)
        assert tags.status_code == 200 and REPO in [m["name"] for m in tags.json()["models"]]
        ps = httpx.get(live.url + "/api/ps", timeout=60)
        assert ps.status_code == 200 and [m["name"] for m in ps.json()["models"]] == [REPO]
        assert "deleted" in error_of(httpx.post(live.url + "/api/show", json={"model": REPO}, timeout=60), 410)
        health = httpx.get(live.url + "/health").json()
        assert health["status"] == "degraded" and REPO in health["warnings"][0]
        assert chat(live, REPO).status_code == 200  # it still answers from memory

        assert httpx.post(live.url + "/api/generate", json={"model": REPO, "keep_alive": 0}).status_code == 200
        assert "deleted" in error_of(chat(live, REPO), 410)
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and "deleted" in health.json()["error"]
        openai = httpx.post(live.url + "/v1/chat/completions", json={"model": REPO, "messages": MESSAGES})
        assert openai.status_code == 410 and openai.json()["error"]["code"] == "model_files_gone"


@pytest.mark.parametrize("path", ["/etc/passwd", "/no/such/file", "~", "./", "../model.gguf", "~/.ssh/id_rsa"])
def test_a_path_gets_the_answer_any_unknown_model_gets(stories_path, path):
    with live_store(stories_path, STORIES) as live:
        assert error_of(delete(live, path), 404) == f"model '{path}' not found"
        assert error_of(delete(live, str(stories_path)), 404) == f"model '{stories_path}' not found"


def test_a_load_error_keeps_the_servers_folders_to_its_log(pulled, stories_path, caplog):
    (pulled / "tokenizer.json").unlink()
    (pulled / "tokenizer.json").write_text("{damaged")
    with live_store(stories_path, STORIES) as live:
        response = httpx.post(live.url + "/v1/chat/completions", json={"model": REPO, "messages": MESSAGES})
        assert response.status_code == 500 and response.json()["error"]["code"] == "load_failed", response.text
        assert str(Path.home()) not in response.text and str(pulled.parent) not in response.text
        assert "/" not in response.json()["error"]["message"].replace(REPO, "")


def test_the_open_health_names_no_path(scheduler):
    from ferrum_mac.serve.app import build_app

    live = LiveServer(build_app(scheduler, api_key=API_KEY))
    try:
        health = httpx.get(live.url + "/health")
        assert health.status_code == 200 and health.json()["model"] == STORIES
        assert httpx.get(live.url + "/v1/models").status_code == 401
    finally:
        live.stop()


# -- pulls always end ------------------------------------------------------------------------------


def test_a_pull_from_a_hub_answering_with_a_web_page_ends_with_an_error(hub, stories_path):
    hub.portal.add(REPO)
    with live_store(stories_path, STORIES) as live:
        with httpx.stream("POST", live.url + "/api/pull", json={"model": REPO}, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[0] == '{"status": "pulling manifest"}' and len(lines) == 2
        assert "other than a Hugging Face Hub" in lines[-1] and '"error"' in lines[-1]
        whole = httpx.post(live.url + "/api/pull", json={"model": REPO, "stream": False}, timeout=30)
        assert "other than a Hugging Face Hub" in error_of(whole, 502)


def test_sigterm_ends_a_server_with_a_pull_running(hub, stories_path, tmp_path):
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    hub.slow.add((REPO, "model.safetensors"))
    hub.slow_pause_s = 0.2  # a minute for the file: the pull is still running when the server is told to stop
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    command = [sys.executable, "-m", "ferrum_mac.cli", "serve", str(stories_path), "--port", str(port)]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "serving" not in (line := server.stderr.readline()) and time.monotonic() < deadline:
            assert line, "the server ended before it served"
        url = f"http://127.0.0.1:{port}/api/pull"
        after: list[str] = []
        with httpx.stream("POST", url, json={"model": REPO}, timeout=90) as response:
            lines = response.iter_lines()
            for line in lines:
                if json.loads(line).get("digest") == "model.safetensors":
                    break  # the weights are arriving
            server.send_signal(signal.SIGTERM)
            try:
                after += lines
            except httpx.HTTPError:  # cut: what a stopping server does to an answer past its grace
                pass
            server.wait(timeout=60)
        assert not any("success" in line for line in after)  # it stopped the pull rather than wait for it
        from ferrum_mac.store import hub_cache

        assert hub_cache.partial_files(REPO) and not hub_cache.repo_dir(REPO).joinpath("snapshots").exists()
    finally:
        server.kill()
        server.wait()


def test_a_failure_message_for_clients_keeps_the_servers_folders_to_its_log(caplog):
    from ferrum_mac.serve.batching.batch import one_line

    error = IsADirectoryError(21, "Is a directory", "/home/someone/.cache/ferrum_mac/prefix-cache/3f/ab12.blk")
    assert one_line(error) == "[Errno 21] Is a directory: 'ab12.blk'"
    assert "/home/someone/.cache/ferrum_mac/prefix-cache/3f/ab12.blk" in caplog.text
