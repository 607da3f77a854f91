"""A Google Cloud Storage emulator on this machine, for tests of `gs://` work directories.

Nothing leaves the machine: the objects of bucket B live as files under `root/B/`, and both clients
a run uses see the same files.
- **TensorStore** (orbax's array writer) talks to a small HTTP server implementing the part of the
  GCS JSON API that its `gcs` driver uses (read with ranges and generation preconditions, metadata,
  media upload with preconditions, delete, list by prefix and range), found through
  `TENSORSTORE_GCS_HTTP_URL`, with the fixed test token of `GOOGLE_AUTH_TOKEN_FOR_TESTING`.
- **etils.epath** (every other output, and orbax's metadata) reaches `gs://` through fsspec: the
  `gs`/`gcs` protocols are registered to a directory file system over `root`.

An object's generation is its file's modification time in nanoseconds (bumped on rewrite), so the
two views agree. What a real bucket does and this does not: directories exist here (fsspec creates
them; GCS has only name prefixes), and there are no permissions or quotas.

Use: `with emulated_gcs(root):` serves this process and the processes it starts while the block
runs (they inherit the variables, and `tests/gcs_site/sitecustomize.py`, put on their PYTHONPATH,
registers fsspec in them).
"""
from __future__ import annotations

import contextlib
import http.server
import json
import os
import pathlib
import threading
import urllib.parse
from collections.abc import Iterator

ENV_ROOT = "WORKFLOW_R1_TEST_GCS_ROOT"  # where a child process's fsspec `gs://` points (tests/gcs_site)


def _generation(path: pathlib.Path) -> int:
    return path.stat().st_mtime_ns


def _metadata(bucket: str, name: str, path: pathlib.Path) -> dict:
    st = path.stat()
    return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(st.st_size),
            "generation": str(st.st_mtime_ns), "metageneration": "1"}


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: pathlib.Path
    lock: threading.Lock

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing -----------------------------------------------------------------------------------

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj: dict) -> None:
        self._reply(code, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _error(self, code: int, message: str) -> None:
        self._json(code, {"error": {"code": code, "message": message}})

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _parse(self) -> tuple[list[str], dict[str, str]]:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/")]
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        return parts, query

    def _object(self, bucket: str, name: str) -> pathlib.Path:
        path = (self.root / bucket / name).resolve()
        if not str(path).startswith(str((self.root / bucket).resolve())):
            raise PermissionError(name)
        return path

    def _precondition(self, path: pathlib.Path, query: dict[str, str]) -> int | None:
        """The HTTP status a failed generation precondition answers with, or None when it holds."""
        current = _generation(path) if path.is_file() else 0
        if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != current:
            return 412
        if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == current:
            return 304 if self.command == "GET" else 412
        return None

    def _refused(self, path: pathlib.Path, bucket: str, name: str, query: dict[str, str]) -> bool:
        """Answers (and returns True) when the object is missing or a generation precondition fails."""
        if not path.is_file():
            self._error(404, f"no such object: {bucket}/{name}")
            return True
        failed = self._precondition(path, query)
        if failed == 304:
            self._reply(304)
        elif failed:
            self._error(failed, "precondition failed")
        return failed is not None

    # -- verbs --------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        parts, query = self._parse()
        # /storage/v1/b/{bucket}/o  or  /storage/v1/b/{bucket}/o/{object}
        if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 5 or (len(parts) > 5 and parts[5] != "o"):
            return self._error(404, "unknown path")
        if len(parts) == 5:  # the bucket's own metadata (google-cloud-storage's get_bucket, used by orbax)
            return self._json(200, {"kind": "storage#bucket", "name": parts[4], "id": parts[4],
                                    "hierarchicalNamespace": {"enabled": False}})
        bucket = parts[4]
        if len(parts) == 6 or (len(parts) == 7 and parts[6] == ""):
            return self._list(bucket, query)
        name = "/".join(parts[6:])
        path = self._object(bucket, name)
        with self.lock:
            if self._refused(path, bucket, name, query):
                return
            if query.get("alt") != "media":
                return self._json(200, _metadata(bucket, name, path))
            data, generation = path.read_bytes(), _generation(path)
        headers = {"x-goog-generation": str(generation), "Content-Type": "application/octet-stream"}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first, _, last = rng[len("bytes="):].partition("-")
            if first == "":  # a suffix: the last N bytes
                start, end = max(len(data) - int(last), 0), len(data) - 1
            else:
                start, end = int(first), (int(last) if last else len(data) - 1)
            if start >= len(data) and len(data) > 0:
                return self._reply(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            end = min(end, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._reply(206, data[start:end + 1], headers)
        return self._reply(200, data, headers)

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        prefix, start, end = query.get("prefix", ""), query.get("startOffset", ""), query.get("endOffset")
        base = self.root / bucket
        items = []
        with self.lock:
            for dirpath, _, files in os.walk(base):
                for f in files:
                    name = str(pathlib.Path(dirpath, f).relative_to(base))
                    if name.startswith(prefix) and name >= start and (end is None or name < end):
                        items.append(_metadata(bucket, name, pathlib.Path(dirpath, f)))
        self._json(200, {"kind": "storage#objects", "items": sorted(items, key=lambda m: m["name"])})

    def do_POST(self) -> None:
        parts, query = self._parse()
        body = self._body()
        # /upload/storage/v1/b/{bucket}/o?uploadType=media&name=...
        if parts[1:5] != ["upload", "storage", "v1", "b"] or query.get("uploadType") != "media":
            return self._error(400, f"unsupported upload {self.path}")
        bucket, name = parts[5], query["name"]
        path = self._object(bucket, name)
        with self.lock:
            failed = self._precondition(path, query)
            if failed:
                return self._error(failed, "precondition failed")
            old = _generation(path) if path.is_file() else -1
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.upload")
            tmp.write_bytes(body)
            os.replace(tmp, path)
            if _generation(path) <= old:  # a rewrite within the clock's resolution still changes generation
                os.utime(path, ns=(old + 1, old + 1))
            meta = _metadata(bucket, name, path)
        self._json(200, meta)

    def do_DELETE(self) -> None:
        parts, query = self._parse()
        if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 7:
            return self._error(404, "unknown path")
        bucket, name = parts[4], "/".join(parts[6:])
        path = self._object(bucket, name)
        with self.lock:
            if self._refused(path, bucket, name, query):
                return
            path.unlink()
        self._reply(204)


def serve(root: pathlib.Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Starts the emulator's HTTP server over `root` in a daemon thread; returns (server, its URL)."""
    handler = type("Handler", (_Handler,), {"root": pathlib.Path(root), "lock": threading.Lock()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def register_fsspec(root: str | os.PathLike) -> None:
    """Points fsspec's (and so etils.epath's) `gs://` and `gcs://` at the directory `root`."""
    import fsspec
    from etils.epath import backend
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    class EmulatedGCS(DirFileSystem):
        protocol = ("gs", "gcs")
        cachable = False

        def __init__(self, *args, **kwargs):  # epath passes gcsfs's options (finalize_on_close)
            super().__init__(path=str(root), fs=LocalFileSystem())

    for protocol in ("gs", "gcs"):
        fsspec.register_implementation(protocol, EmulatedGCS, clobber=True)
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()  # epath caches one file system per scheme


def unregister_fsspec() -> None:
    import importlib

    from etils.epath import backend

    for protocol in ("gs", "gcs"):
        # fsspec.registry (the module, not its read-only `registry` view) holds what was registered.
        importlib.import_module("fsspec.registry")._registry.pop(protocol, None)
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()


@contextlib.contextmanager
def emulated_gcs(root: str | os.PathLike) -> Iterator[dict[str, str]]:
    """Serves `root` as GCS for this process (TensorStore and epath) and the processes it starts while
    the block runs; yields the environment variables it set."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    server, url = serve(root)
    site = str(pathlib.Path(__file__).with_name("gcs_site"))  # its sitecustomize registers fsspec in a child
    env = {"TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
           "STORAGE_EMULATOR_HOST": url, ENV_ROOT: str(root),
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    for key in ("no_proxy", "NO_PROXY"):  # the emulator is local: never through a proxy (curl, requests)
        env[key] = ",".join(filter(None, (os.environ.get(key), "127.0.0.1,localhost")))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    register_fsspec(root)
    try:
        yield env
    finally:
        unregister_fsspec()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.shutdown()
        server.server_close()
