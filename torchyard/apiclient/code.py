"""Code packages and script jobs' outputs: ``POST /v1/code`` (a folder packed with its
``.torchyardignore`` applied) and ``GET /v1/jobs/{id}/outputs``."""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from torchyard.apiclient import direct
from torchyard.apiclient.datasets import stores_directly, upload_direct
from torchyard.apiclient.models import CodePackage, Page
from torchyard.apiclient.transport import Transport, raise_for, segment
from torchyard.contract.archive import extract_archive
from torchyard.contract.errors import TorchyardError
from torchyard.contract.manifests import folder_manifest

IGNORE_FILE = ".torchyardignore"


class IgnoreRules:
    """``.torchyardignore`` patterns, with gitignore's syntax: ``#`` comments, ``!`` to
    re-include, a trailing ``/`` for folders only, a ``/`` elsewhere anchors the pattern
    to the folder's root, ``*``, ``?``, ``[...]`` and ``**``. The last matching line wins;
    a file inside an ignored folder stays ignored."""

    def __init__(self, lines: list[str]) -> None:
        self.rules: list[tuple[re.Pattern[str], bool, bool]] = []
        for raw in lines:
            line = raw.rstrip("\n").rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            if negate or line.startswith("\\!") or line.startswith("\\#"):
                line = line[1:]
            dir_only = line.endswith("/")
            line = line.rstrip("/")
            anchored = "/" in line
            line = line.lstrip("/")
            if line:
                prefix = "^" if anchored else "^(?:.*/)?"
                self.rules.append((re.compile(prefix + _translate(line) + "$"), negate, dir_only))

    @classmethod
    def of(cls, folder: Path) -> IgnoreRules:
        path = folder / IGNORE_FILE
        return cls(path.read_text(encoding="utf-8").splitlines() if path.is_file() else [])

    def ignored(self, rel: str, is_dir: bool) -> bool:
        result = False
        for pattern, negate, dir_only in self.rules:
            if dir_only and not is_dir:
                continue
            if pattern.match(rel):
                result = not negate
        return result


def _translate(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == len(pattern):
            out.append("/.*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def code_files(folder: Path) -> tuple[list[str], list[str]]:
    """The files a package of ``folder`` holds (sorted relative paths), and what was left
    out besides ignored entries (links and special files: the service refuses them)."""
    rules = IgnoreRules.of(folder)
    files: list[str] = []
    skipped: list[str] = []
    for root, dirs, names in os.walk(folder):
        base = Path(root).relative_to(folder)
        kept_dirs = []
        for name in sorted(dirs):
            rel = (base / name).as_posix()
            if (Path(root) / name).is_symlink():
                skipped.append(rel)
            elif not name.startswith(".") and not rules.ignored(rel, True):
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in sorted(names):
            rel = (base / name).as_posix()
            path = Path(root) / name
            if name.startswith(".") or rules.ignored(rel, False):
                continue  # hidden files are never part of a package
            if path.is_symlink() or not path.is_file():
                skipped.append(rel)
                continue
            files.append(rel)
    return sorted(files), skipped


def pack_code(folder: Path, dest: Path, files: list[str]) -> None:
    with tarfile.open(dest, "w:gz") as tf:
        for rel in files:
            tf.add(folder / rel, arcname=rel, recursive=False)


class CodeCalls:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def upload_code(
        self, folder: str | Path, name: str | None = None, *, timeout: float = 3600.0
    ) -> CodePackage:
        """Upload a source folder (everything in it but what ``.torchyardignore`` and hidden
        names leave out) or an archive file as a code package.

        With object storage (``GET /v1/storage``) the archive goes straight to the store with
        its manifest (the files' checksums, computed here); each node checks the archive
        against it when it fetches it."""
        source = Path(folder)
        name = name or source.resolve().name.split(".")[0] or "code"
        with tempfile.TemporaryDirectory(prefix="torchyard-code-") as tmp:
            files: list[str] | None = None
            if source.is_dir():
                files, _skipped = code_files(source)
                archive = Path(tmp) / "code.tar.gz"
                pack_code(source, archive, files)
            elif source.is_file():
                archive = source
            else:
                raise FileNotFoundError(f"no such file or folder: {source}")
            if stores_directly(self._transport):
                if files is not None:
                    manifest = folder_manifest(source, files)
                else:
                    manifest = folder_manifest(extract_archive(archive, Path(tmp) / "extracted"))
                data = upload_direct(
                    self._transport,
                    "/v1/code/uploads",
                    archive,
                    fields={"name": name, "manifest": manifest.model_dump()},
                )
                return CodePackage.model_validate(data)
            with open(archive, "rb") as fh:
                data = self._transport.json(
                    "POST",
                    "/v1/code",
                    data={"name": name},
                    files={"file": (archive.name, fh, "application/gzip")},
                    timeout=httpx.Timeout(self._transport.timeout, read=timeout, write=timeout),
                )
        return CodePackage.model_validate(data)

    def list_code(self, *, limit: int | None = None, cursor: str | None = None) -> Page[CodePackage]:
        params: dict[str, Any] = {
            k: v for k, v in {"limit": limit, "cursor": cursor}.items() if v is not None
        }
        return Page[CodePackage].model_validate(self._transport.json("GET", "/v1/code", params=params))

    def get_code(self, code_id: str) -> CodePackage:
        return CodePackage.model_validate(self._transport.json("GET", f"/v1/code/{segment(code_id)}"))

    def delete_code(self, code_id: str) -> None:
        """Delete a code package (409 ``ConflictError`` while a live job uses it)."""
        self._transport.request("DELETE", f"/v1/code/{segment(code_id)}")

    def download_outputs(self, job_id: str, dest: str | Path, *, path: str | None = None) -> Path:
        """A script job's outputs archive (or, with ``path``, one file of it) written to
        ``dest``, checked against its sha256 (the ETag)."""
        target = Path(dest)
        part = target.with_name(target.name + ".part")
        target.parent.mkdir(parents=True, exist_ok=True)
        params = {"path": path} if path is not None else None
        hasher = hashlib.sha256()
        try:
            with self._transport.http.stream(
                "GET",
                f"/v1/jobs/{segment(job_id)}/outputs",
                params=params,
                timeout=self._transport.read_timeout(300.0),
                follow_redirects=True,  # object storage: the whole archive from a presigned URL
            ) as response:
                raise_for(response)
                etag = direct.api_headers(response).get("etag", "").strip().strip('"')
                with open(part, "wb") as out:
                    for chunk in _chunks(response):
                        hasher.update(chunk)
                        out.write(chunk)
        except httpx.TransportError as exc:
            part.unlink(missing_ok=True)
            raise self._transport.unreachable(exc) from exc
        if etag and hasher.hexdigest() != etag:
            part.unlink(missing_ok=True)
            raise TorchyardError(f"downloaded outputs sha256 {hasher.hexdigest()} does not match {etag}")
        os.replace(part, target)
        return target


def _chunks(response: httpx.Response) -> Iterator[bytes]:
    yield from response.iter_bytes(1 << 20)
