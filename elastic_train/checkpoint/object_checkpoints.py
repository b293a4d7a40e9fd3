"""Checkpoints in an object store: the same promises as storage.py without a filesystem.

Layout under ``s3://bucket/<prefix>/checkpoints``::

    step-00000050/state-<hex>.pt      the payload (torch.save), a name of its own per save
    step-00000050/manifest.json       as on disk (storage.py), naming the payload it covers
    step-00000050.corrupt-<t>-<hex>/  a checkpoint set aside as corrupt (bytes kept)

A save uploads the payload first (large ones in parts: an upload is invisible until every
part is in, so a crash leaves an incomplete upload, never a partial object), then writes the
manifest in one request: **the manifest is the commit point**. A step without a manifest is
a torn save, never listed and never restored. The payload's name is new on every save, so a
new manifest replaces an old checkpoint of the same step in one write, never a mix of the
two. What a save leaves behind (payloads no manifest names, incomplete uploads) is removed
at the next restore, when no save of the run can be in flight.

Retention deletes a checkpoint's manifest first (it stops being a checkpoint at once), then
its payload. Verification streams the payload through sha256; loading reads it into memory
and unpickles nothing but tensors (``weights_only``).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic_train.checkpoint.api import (
    CheckpointInfo,
    CheckpointStorage,
    PayloadUpload,
    Serialized,
    Verdict,
)
from elastic_train.checkpoint.object_keys import PAYLOAD_KEY, STEP_DIR, payload_name
from elastic_train.checkpoint.object_store import Listed, ObjectStore
from elastic_train.checkpoint.storage import (
    MANIFEST,
    build_manifest,
    load_payload,
    manifest_problem,
    serialize,
    step_dirname,
    unreadable_verdict,
)
from elastic_train.errors import CheckpointCorruptError, StorageError


class ObjectPath(str):
    """A checkpoint's URL, with the one Path-like attribute readers use (``name``)."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ObjectCheckpointInfo(CheckpointInfo):
    """A listed checkpoint: also the objects found under it, with their sizes."""

    objects: tuple[Listed, ...] = ()

    @property
    def size_bytes(self) -> int:
        if self.manifest is None:
            return sum(o.size for o in self.objects)
        return sum(int(f["bytes"]) for f in self.manifest["files"].values())


class ObjectCheckpointStore(CheckpointStorage):
    """The checkpoints of one run directory in an object store (api.py's contract)."""

    remote = True

    def __init__(self, objects: ObjectStore, prefix: str) -> None:
        self.objects = objects
        self.prefix = prefix.strip("/")
        self.root = ObjectPath(f"s3://{objects.location.bucket}/{self.prefix}")

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def _url(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.root}/{name}")

    def _dirs(self) -> dict[str, list[Listed]]:
        """Every object under the store, by its first path component."""
        found: dict[str, list[Listed]] = defaultdict(list)
        for listed in self.objects.list(self.prefix + "/"):
            relative = listed.key[len(self.prefix) + 1:]
            head, _, _ = relative.partition("/")
            found[head].append(listed)
        return found

    # ---- writing -------------------------------------------------------------------------
    def write(self, step: int, payload: Mapping[str, Any] | Serialized, meta: Mapping[str, Any],
              *, fault_hook: Any = None,
              before_commit: Callable[[], None] | None = None,
              upload: PayloadUpload | None = None) -> CheckpointInfo:
        """Upload ``payload`` as checkpoint ``step``, manifest last; return its info.

        ``fault_hook(stage)`` is called between the stages (tests crash there);
        ``before_commit()`` runs just before the manifest is written; what it raises
        abandons the save (the writer fence). ``upload``, when given, uploads the payload
        instead of this process (the commit stays here). A failure removes this save's
        payload and leaves every committed checkpoint as it was.
        """
        hook = fault_hook or (lambda stage: None)
        directory = step_dirname(step)
        name = payload_name()
        payload_key = self._key(directory, name)
        hook("tmp-created")
        serialized = payload if isinstance(payload, Serialized) else serialize(payload)
        hook("payload-written")
        try:
            if upload is None or not upload(self._url(f"{directory}/{name}"),
                                            self.objects.client_options(), serialized):
                self.objects.upload(payload_key, serialized.data)
            hook("payload-synced")
            manifest = build_manifest(step, meta, {name: {"bytes": serialized.bytes,
                                                          "sha256": serialized.sha256}})
            hook("manifest-synced")
            if before_commit is not None:
                before_commit()
            old = self.objects.get(self._key(directory, MANIFEST))
            if old is not None:  # a checkpoint no restore took (corrupt, superseded)
                self._set_aside_dir(directory, keep=frozenset({payload_key}))
            self.objects.put(self._key(directory, MANIFEST),
                             json.dumps(manifest, indent=1, sort_keys=True).encode())
            hook("renamed")
        except BaseException:
            try:
                self.objects.delete([payload_key])
            except StorageError:
                pass  # a leftover, removed at the next restore
            raise
        return CheckpointInfo(self._url(directory), step, manifest)

    def _set_aside_dir(self, directory: str, keep: frozenset[str] = frozenset()) -> ObjectPath:
        """Copy a step's objects to ``step-N.corrupt-…`` and delete them there (manifest
        first): out of every listing and of retention's count, the bytes kept."""
        aside = f"{directory}.corrupt-{int(time.time())}-{secrets.token_hex(2)}"
        listed = [o for o in self.objects.list(self._key(directory) + "/") if o.key not in keep]
        for obj in listed:
            self.objects.copy(obj.key, self._key(aside, obj.key.rsplit("/", 1)[-1]))
        manifest = [o.key for o in listed if o.key.endswith("/" + MANIFEST)]
        self.objects.delete(manifest)
        self.objects.delete([o.key for o in listed if o.key not in manifest])
        return self._url(aside)

    def set_aside(self, info: CheckpointInfo) -> ObjectPath:
        """Set a corrupt checkpoint aside (see ``_set_aside_dir``); its new URL."""
        return self._set_aside_dir(step_dirname(info.step))

    def set_aside_dirs(self) -> list[ObjectPath]:
        """Checkpoints set aside as corrupt."""
        return sorted(self._url(name) for name in self._dirs() if ".corrupt-" in name)

    # ---- reading -------------------------------------------------------------------------
    def _read_manifest(self, directory: str, step: int, objects: tuple[Listed, ...] = ()
                       ) -> ObjectCheckpointInfo:
        url = self._url(directory)
        raw = self.objects.get(self._key(directory, MANIFEST))
        if raw is None:
            return ObjectCheckpointInfo(url, step, None, "manifest.json is missing", objects)
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            return ObjectCheckpointInfo(url, step, None, f"manifest.json is unreadable ({exc})",
                                        objects)
        problem = manifest_problem(manifest, step)
        if problem is not None:
            return ObjectCheckpointInfo(url, step, None, problem, objects)
        return ObjectCheckpointInfo(url, step, manifest, None, objects)

    def read_info(self, path: object, step: int) -> CheckpointInfo:
        """Parse one checkpoint's manifest (``path``: its URL or directory name)."""
        return self._read_manifest(str(path).rstrip("/").rsplit("/", 1)[-1], step)

    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint (a step with a manifest), newest first."""
        found = []
        for name, objects in self._dirs().items():
            match = STEP_DIR.match(name)
            if match and any(o.key.endswith("/" + MANIFEST) for o in objects):
                found.append((int(match.group(1)), name, tuple(objects)))
        found.sort(reverse=True)
        return [self._read_manifest(name, step, objects) for step, name, objects in found]

    def verify(self, info: CheckpointInfo) -> Verdict:
        """Check the manifest, the format version and every payload's size and sha256."""
        refused = unreadable_verdict(info)
        if refused is not None:
            return refused
        assert info.manifest is not None
        directory = step_dirname(info.step)
        sizes = {o.key: o.size for o in getattr(info, "objects", ())} or {
            o.key: o.size for o in self.objects.list(self._key(directory) + "/")}
        checked = 0
        for name, expected in info.manifest["files"].items():
            key = self._key(directory, name)
            if key not in sizes:
                return Verdict(info, False, f"{name} is missing")
            if sizes[key] != int(expected["bytes"]):
                return Verdict(info, False, f"{name} has {sizes[key]} bytes, the manifest "
                               f"says {expected['bytes']}")
            digest = hashlib.sha256()
            for chunk in self.objects.chunks(key):
                digest.update(chunk)
                checked += len(chunk)
            if digest.hexdigest() != expected["sha256"]:
                return Verdict(info, False, f"{name} fails its sha256 checksum")
        return Verdict(info, True, None, checked)

    def load(self, info: CheckpointInfo, map_location: str | torch.device = "cpu"
             ) -> dict[str, Any]:
        """Read the payload (checked against the manifest's sha256) and load it safely."""
        if info.manifest is None:
            info = self.read_info(info.path, info.step)
            if info.manifest is None:
                raise CheckpointCorruptError(f"checkpoint {info.path} cannot be read "
                                             f"({info.problem})")
        (name, expected), = info.manifest["files"].items()
        data = self.objects.download(self._key(step_dirname(info.step), name))
        if hashlib.sha256(data.getbuffer()).hexdigest() != expected["sha256"]:
            raise CheckpointCorruptError(f"checkpoint {info.path}: {name} fails its sha256 "
                                         "checksum; it was not loaded")
        return load_payload(data, info.path, map_location)

    def locate(self, path: str, step: int) -> CheckpointInfo:
        """A checkpoint chosen elsewhere (rank 0's decision), by its URL."""
        return CheckpointInfo(ObjectPath(path), step, None)

    # ---- housekeeping --------------------------------------------------------------------
    def _leftover_objects(self) -> list[Listed]:
        """Payloads of saves that did not commit: in steps without a manifest, or not named
        by their step's manifest. Objects of other names are not ours: never touched."""
        stray = []
        for name, objects in self._dirs().items():
            if not STEP_DIR.match(name):
                continue
            manifest = next((o for o in objects if o.key.endswith("/" + MANIFEST)), None)
            if manifest is None:
                stray.extend(o for o in objects if PAYLOAD_KEY.search(o.key))
                continue
            info = self._read_manifest(name, int(name[5:]), tuple(objects))
            if info.manifest is None:
                continue  # a broken checkpoint: restore sets it aside, bytes kept
            named = {self._key(name, n) for n in info.manifest["files"]} | {manifest.key}
            stray.extend(o for o in objects if o.key not in named and PAYLOAD_KEY.search(o.key))
        return stray

    def _incomplete_uploads(self) -> list[tuple[str, str]]:
        return [(key, upload) for key, upload in
                self.objects.incomplete_uploads(self.prefix + "/") if PAYLOAD_KEY.search(key)]

    def leftovers(self) -> list[ObjectPath]:
        """Objects and incomplete uploads of saves that did not finish."""
        found = [ObjectPath(f"s3://{self.objects.location.bucket}/{o.key}")
                 for o in self._leftover_objects()]
        found += [ObjectPath(f"s3://{self.objects.location.bucket}/{key} (incomplete upload)")
                  for key, _ in self._incomplete_uploads()]
        return found

    def remove_leftovers(self) -> list[ObjectPath]:
        """Delete the leftovers (only when no save of this run can be in flight)."""
        stray = self._leftover_objects()
        uploads = self._incomplete_uploads()
        self.objects.delete([o.key for o in stray])
        for key, upload_id in uploads:
            self.objects.abort_upload(key, upload_id)
        return ([ObjectPath(f"s3://{self.objects.location.bucket}/{o.key}") for o in stray]
                + [ObjectPath(f"s3://{self.objects.location.bucket}/{key} (incomplete upload)")
                   for key, _ in uploads])

    def apply_retention(self, keep: int, newest: int) -> list[ObjectPath]:
        """As on disk (storage.py): keep the ``keep`` newest complete checkpoints up to
        ``newest``; a broken one neither counts nor is deleted. Manifest first."""
        if keep < 1:
            raise ValueError("keep must be at least 1")
        complete = [info for info in self.list()
                    if info.manifest is not None and info.step <= newest]
        deleted = []
        for info in complete[keep:]:
            directory = step_dirname(info.step)
            self.objects.delete([self._key(directory, MANIFEST)])
            self.objects.delete([o.key for o in getattr(info, "objects", ())
                                 if not o.key.endswith("/" + MANIFEST)])
            deleted.append(ObjectPath(info.path))
        return deleted
