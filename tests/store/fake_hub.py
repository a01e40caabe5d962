"""A Hugging Face Hub look-alike on 127.0.0.1 for the store tests.

It answers the requests huggingface_hub 1.x/2.x makes, with the same shapes:
  GET  /api/models/{repo}[/revision/{rev}]     model info; `siblings` carry size, blobId and lfs{sha256,size}
  GET  /api/models/{repo}/tree/{rev}            the file tree (snapshot_download lists it)
  HEAD/GET /{repo}/resolve/{rev}/{path}        small files: 200 with ETag (git blob id), X-Repo-Commit,
                                                Content-Length; LFS files: 302 to the "CDN" (a second server,
                                                another origin, as the Hub's CDN is) with X-Linked-Etag
                                                (sha256) and X-Linked-Size
  GET  {cdn}/lfs/{repo}/{sha256}               the LFS content, honouring Range (206 + Content-Range)
No X-Xet-* headers and no `xetHash` fields, so clients take the plain HTTP path.

A hostile Hub is one whose FakeRepo has a `sha` that is no commit hash, `revisions` it answers
to, or `files` with odd names. Faults a test can switch on: `deny[repo] = (status, X-Error-Code or None)`, `corrupt.add((repo, path))`
(same length, wrong bytes), `cut[(repo, path)] = n` (send n bytes of the body, drop the connection,
then answer 503 for that file until `heal()`), `portal.add(repo)` (answer its model information
with 200 and an HTML page, as a captive portal or a proxy does), `slow.add((repo, path))` (send
that file's body a little at a time, for pulls still running when something else happens).
Every request is logged in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pth")
SLOW_PIECE = 4096  # a slow file is sent this much at a time, `FakeHub.slow_pause_s` apart


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    sha: str = ""
    card: dict = field(default_factory=lambda: {"license": "mit"})
    revisions: set = field(default_factory=set)  # names besides "main" and `sha` the Hub answers to

    def __post_init__(self):
        if not self.sha:
            self.sha = hashlib.sha1(
                json.dumps(sorted((p, git_blob_id(d)) for p, d in self.files.items())).encode()
            ).hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def sha256(self, path: str) -> str:
        return hashlib.sha256(self.files[path]).hexdigest()

    def pointer(self, path: str) -> bytes:
        data = self.files[path]
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256(path)}\nsize {len(data)}\n".encode()
        )

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        if not self.is_lfs(path):
            return {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
        pointer = self.pointer(path)
        return {
            "rfilename": path,
            "size": len(data),
            "blobId": git_blob_id(pointer),
            "lfs": {"sha256": self.sha256(path), "size": len(data), "pointerSize": len(pointer)},
        }

    def tree_entry(self, path: str) -> dict:
        s = self.sibling(path)
        entry = {"type": "file", "oid": s["blobId"], "size": s["size"], "path": path}
        if "lfs" in s:
            entry["lfs"] = {"oid": s["lfs"]["sha256"], "size": s["size"], "pointerSize": s["lfs"]["pointerSize"]}
        return entry

    def info(self) -> dict:
        return {
            "_id": str(self.sha)[:24],
            "id": self.repo_id,
            "modelId": self.repo_id,
            "sha": self.sha,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["safetensors"],
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "cardData": self.card,
            "siblings": [self.sibling(p) for p in sorted(self.files)],
        }


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.deny: dict[str, tuple[int, str | None]] = {}
        self.tokens: dict[str, str] = {}  # repo -> the bearer token that lifts its `deny`
        self.corrupt: set[tuple[str, str]] = set()
        self.cut: dict[tuple[str, str], int] = {}
        self.down: set[tuple[str, str]] = set()
        self.portal: set[str] = set()
        self.slow: set[tuple[str, str]] = set()
        self.slow_pause_s = 0.05  # 80 kB/s
        self.requests: list[dict] = []
        self.sent: dict[tuple[str, str], int] = {}  # body bytes sent per file
        self._lock = threading.Lock()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self)) for _ in ("hub", "cdn")]
        self._threads = [threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in self._servers]
        for server in self._servers:
            server.daemon_threads = True

    @property
    def url(self) -> str:
        return _url_of(self._servers[0])

    @property
    def cdn_url(self) -> str:
        return _url_of(self._servers[1])

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def heal(self) -> None:
        self.down.clear()

    def file_requests(self, path: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == "GET" and r["file"] == path]

    def start(self) -> "FakeHub":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        for server, thread in zip(self._servers, self._threads):
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


def _url_of(server) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}"


def _handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        def do_HEAD(self):
            self._route(body=False)

        def do_GET(self):
            self._route(body=True)

        # -- routing ---------------------------------------------------------------------
        def _route(self, body: bool):
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            entry = {
                "method": self.command,
                "path": path,
                "file": None,
                "range": self.headers.get("Range"),
                "auth": self.headers.get("Authorization"),
            }
            with hub._lock:
                hub.requests.append(entry)
            segments = path.strip("/").split("/")
            if segments[:2] == ["api", "models"] and len(segments) >= 4:
                return self._api(segments[2] + "/" + segments[3], segments[4:])
            if segments[0] == "lfs" and len(segments) == 4:
                return self._lfs(f"{segments[1]}/{segments[2]}", segments[3], body, entry)
            if len(segments) >= 5 and segments[2] == "resolve":
                return self._resolve(f"{segments[0]}/{segments[1]}", segments[3], "/".join(segments[4:]), body, entry)
            self._error(404, None, "no such route")

        def _repo(self, repo_id: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo_id in hub.deny:
                token = hub.tokens.get(repo_id)
                if token is None or self.headers.get("Authorization") != f"Bearer {token}":
                    status, code = hub.deny[repo_id]
                    self._error(status, code, "Access denied")
                    return None
            return repo

        def _revision_ok(self, repo: FakeRepo, revision: str) -> bool:
            if revision in ("main", repo.sha) or revision in repo.revisions:
                return True
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return False

        # -- API ---------------------------------------------------------------------------
        def _api(self, repo_id: str, rest: list[str]):
            repo = self._repo(repo_id)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                if rest and not self._revision_ok(repo, "/".join(rest[1:])):  # a revision may hold slashes
                    return
                if repo_id in hub.portal:
                    page = b"<!doctype html><html><body>Sign in to the network</body></html>"
                    return self._send(200, {"Content-Type": "text/html", "Content-Length": str(len(page))}, page)
                return self._json(repo.info())
            if rest[0] == "tree":
                if not self._revision_ok(repo, rest[1]):
                    return
                return self._json([repo.tree_entry(p) for p in sorted(repo.files)])
            self._error(404, None, "no such route")

        # -- files -------------------------------------------------------------------------
        def _resolve(self, repo_id: str, revision: str, file: str, body: bool, entry: dict):
            repo = self._repo(repo_id)
            if repo is None or not self._revision_ok(repo, revision):
                return
            if file not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
            entry["file"] = file
            headers = {"X-Repo-Commit": repo.sha}
            if repo.is_lfs(file):
                headers.update(
                    {
                        "Location": f"{hub.cdn_url}/lfs/{repo_id}/{repo.sha256(file)}",
                        "X-Linked-Etag": f'"{repo.sha256(file)}"',
                        "X-Linked-Size": str(len(repo.files[file])),
                        "ETag": f'"{git_blob_id(repo.pointer(file))}"',
                        "Content-Length": "0",
                    }
                )
                return self._send(302, headers, b"")
            headers["ETag"] = f'"{git_blob_id(repo.files[file])}"'
            self._content(repo, file, headers, body)

        def _lfs(self, repo_id: str, sha256: str, body: bool, entry: dict):
            repo = hub.repos.get(repo_id)
            file = next((p for p in (repo.files if repo else ()) if repo.sha256(p) == sha256), None)
            if file is None:
                return self._error(404, None, "no such object")
            entry["file"] = file
            self._content(repo, file, {"ETag": f'"{sha256}"'}, body)

        def _content(self, repo: FakeRepo, file: str, headers: dict, body: bool):
            key = (repo.repo_id, file)
            if key in hub.down:
                return self._error(503, None, "Service unavailable")
            data = repo.files[file]
            if key in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start, status = self._range_start(len(data))
            if start is None:
                return
            headers.update({"Accept-Ranges": "bytes", "Content-Length": str(len(data) - start)})
            if status == 206:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            payload = data[start:] if body else b""
            if body and key in hub.cut:
                payload = payload[: hub.cut.pop(key)]
                hub.down.add(key)
                self.close_connection = True
            with hub._lock:
                hub.sent[key] = hub.sent.get(key, 0) + len(payload)
            if key in hub.slow:
                return self._trickle(status, headers, payload)
            self._send(status, headers, payload)

        def _trickle(self, status: int, headers: dict, payload: bytes):
            self._send(status, headers, b"")
            for start in range(0, len(payload), SLOW_PIECE):
                time.sleep(hub.slow_pause_s)
                try:
                    self.wfile.write(payload[start : start + SLOW_PIECE])
                    self.wfile.flush()
                except OSError:  # the client went
                    return

        def _range_start(self, size: int) -> tuple[int | None, int]:
            text = self.headers.get("Range")
            if not text:
                return 0, 200
            start = int(text.removeprefix("bytes=").split("-")[0])  # clients here ask for "bytes=N-"
            if start >= size:
                self._send(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"}, b"")
                return None, 416
            return start, 206

        # -- responses ---------------------------------------------------------------------
        def _json(self, payload):
            data = json.dumps(payload).encode()
            self._send(200, {"Content-Type": "application/json", "Content-Length": str(len(data))}, data)

        def _error(self, status: int, code: str | None, message: str, extra: dict | None = None):
            data = json.dumps({"error": message}).encode()
            headers = {"Content-Type": "application/json", "Content-Length": str(len(data)), "X-Error-Message": message}
            if code:
                headers["X-Error-Code"] = code
            headers.update(extra or {})
            self._send(status, headers, data if self.command != "HEAD" else b"")

        def _send(self, status: int, headers: dict, payload: bytes):
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if payload:
                self.wfile.write(payload)
            self.wfile.flush()

    return Handler
