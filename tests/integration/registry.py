"""A read-only Docker registry on loopback, serving images this engine already has.

No registry is reachable from the test machines, yet a pull is something the
provider really does. This serves the Registry HTTP API v2 subset a pull uses
(``/v2/``, manifests by tag, blobs by digest) for images exported with ``docker
save``: the layers are gzipped once, the manifest is Docker's schema 2. The
engine treats registries on 127.0.0.0/8 as insecure (plain HTTP) by default, so
``docker pull 127.0.0.1:PORT/NAME:TAG`` works with no daemon configuration.

``delay`` slows every blob read (seconds per 64 KiB) so a pull lasts long enough
to report progress.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG = "application/vnd.docker.container.image.v1+json"
LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Registry:
    host: str
    port: int
    blobs: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[tuple[str, str], bytes] = field(default_factory=dict)
    delay: float = 0.0
    blob_requests: int = 0
    taught: set[str] = field(default_factory=set)
    """Source images whose layers the engine has pulled from here once (see :meth:`add`)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def add(
        self,
        engine: Any,
        source: str,
        name: str,
        tag: str,
        *,
        new_layer: int = 0,
        new_config: bool = False,
    ) -> list[int]:
        """Serve the engine's image ``source`` as ``NAME:TAG``; the layer blob sizes.

        Layers the engine has already are never downloaded again (it does not even
        report them): ``new_layer`` adds one of that many random bytes on top, which
        the pull must fetch. The engine knows a layer it has by the digest of the blob
        it was pulled as, which an image built here (``docker import``) never was: so
        with ``new_layer`` the source image itself is first pulled once from here
        (untimed, uncounted), and only the new layer is then left to fetch.
        ``new_config``: the source's layers under a config of its own (the engine
        skips a pull whose config it has, and would learn nothing)."""
        if new_layer and source not in self.taught:
            self.taught.add(source)
            known = f"known-{tag}"
            self.add(engine, source, "gpumesh-test/base", known, new_config=True)
            engine.images.pull(f"{self.address}/gpumesh-test/base", tag=known)
            engine.images.remove(f"{self.address}/gpumesh-test/base:{known}")  # its tag only
            self.blob_requests = 0
        saved = io.BytesIO(b"".join(engine.images.get(source).save(named=True)))
        with tarfile.open(fileobj=saved) as tar:

            def member(path: str) -> bytes:
                extracted = tar.extractfile(path)
                assert extracted is not None
                return extracted.read()

            (entry,) = json.loads(member("manifest.json"))
            config = member(entry["Config"])
            tars = [member(path) for path in entry["Layers"]]
        if new_layer:
            tars.append(_random_layer(new_layer))
            settings = json.loads(config)
            settings["rootfs"]["diff_ids"].append(_digest(tars[-1]))
            settings.setdefault("history", []).append({"created_by": "gpumesh test layer"})
            config = json.dumps(settings).encode()
        elif new_config:
            settings = json.loads(config)
            settings.setdefault("config", {}).setdefault("Labels", {})
            settings["config"]["Labels"] = {**(settings["config"]["Labels"] or {}), "t": tag}
            config = json.dumps(settings).encode()
        layers = [gzip.compress(tar, mtime=0) for tar in tars]
        self.blobs[_digest(config)] = config
        for layer in layers:
            self.blobs[_digest(layer)] = layer
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {"mediaType": CONFIG, "size": len(config), "digest": _digest(config)},
            "layers": [
                {"mediaType": LAYER, "size": len(layer), "digest": _digest(layer)}
                for layer in layers
            ],
        }
        self.manifests[(name, tag)] = json.dumps(manifest).encode()
        return [len(layer) for layer in layers]


def _random_layer(size: int) -> bytes:
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("gpumesh-test-layer.bin")
        info.size = size
        tar.addfile(info, io.BytesIO(os.urandom(size)))
    return data.getvalue()


def _handler(registry: Registry) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the test's output is the engine's

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, *, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/v2", "/v2/"):
                return self._send(200, b"{}", "application/json", body)
            if path.startswith("/v2/") and "/manifests/" in path:
                name, _, ref = path[4:].partition("/manifests/")
                manifest = registry.manifests.get((name, ref))
                if manifest is None:
                    by_digest = [m for m in registry.manifests.values() if _digest(m) == ref]
                    manifest = by_digest[0] if by_digest else None
                if manifest is None:
                    return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "", body)
                return self._send(200, manifest, MANIFEST, body, _digest(manifest))
            if path.startswith("/v2/") and "/blobs/" in path:
                blob = registry.blobs.get(path.rsplit("/", 1)[-1])
                if blob is None:
                    return self._send(404, b'{"errors":[{"code":"BLOB_UNKNOWN"}]}', "", body)
                registry.blob_requests += body
                return self._send(200, blob, "application/octet-stream", body, _digest(blob))
            return self._send(404, b"{}", "application/json", body)

        def _send(
            self, code: int, data: bytes, kind: str, body: bool, digest: str | None = None
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind or "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            if digest:
                self.send_header("Docker-Content-Digest", digest)
            self.end_headers()
            if not body:
                return
            for start in range(0, len(data), 64 * 1024):
                self.wfile.write(data[start : start + 64 * 1024])
                self.wfile.flush()
                if registry.delay and kind == "application/octet-stream":
                    time.sleep(registry.delay)

    return Handler


@contextmanager
def local_registry(delay: float = 0.0) -> Iterator[Registry]:
    """A registry on 127.0.0.1 (a free port) for the duration of the block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    registry = Registry("127.0.0.1", server.server_address[1], delay=delay)
    server.RequestHandlerClass = _handler(registry)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test registry", daemon=True)
    thread.start()
    try:
        yield registry
    finally:
        server.shutdown()
        server.server_close()
