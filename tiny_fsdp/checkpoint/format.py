"""On-disk format of a checkpoint: atomic files, a metadata file, checksums, one reader.

[Note: checkpoint directory]
A checkpoint is a directory holding data files and ``checkpoint.json``, the metadata::

    checkpoint.json                    format name and version, kind, step, world size, every
                                       data file's sha256 and size, and the index: where each
                                       piece of each tensor lives ([Note: checkpoint pieces])
    full-<tag>.pt                      kind "full": everything, written by rank 0
    common-<tag>.pt                    kind "sharded": step, extra, RNG states, param groups
    shard-<tag>-<r>-of-<N>.pt          kind "sharded": rank r's pieces, written by rank r

``<tag>`` (step and a random token) is new for every save, so a save never overwrites a file
that the current metadata names. Every file is written to a temporary name, fsync'ed, and
renamed (atomic on POSIX); the save *commits* by atomically replacing ``checkpoint.json``, after
every data file is complete, and only then deletes the previous save's files. A save that fails
or dies anywhere before the commit leaves the previous checkpoint untouched and loadable; one
that dies after it leaves at most stale files, removed by the next save.

Loading checks the format version, then each data file's size (truncated?) and sha256
(corrupted?) before unpickling it, and raises ``CheckpointError`` saying which file and what is
wrong. Data files are plain ``torch.save`` dicts loadable with ``weights_only=True``.
"""

import hashlib
import json
import os
import uuid
from typing import Any, Dict, List, Optional, Set

import torch

FORMAT_NAME = "tiny_fsdp.checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "checkpoint.json"
DATA_PREFIXES = ("full-", "common-", "shard-")  # files a save owns (and may clean up)
_TMP_MARK = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated, corrupted, of another version, or does not fit."""


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(directory: str, name: str, write: Any) -> Dict[str, Any]:
    """Write ``directory/name`` via a temporary file, fsync, rename; return its record.

    ``write(file_object)`` produces the content. On any error the temporary file is removed and
    ``directory/name`` is left as it was. Record: ``{"sha256": hex, "bytes": size}``.
    """
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".{name}{_TMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        record = {"sha256": sha256_file(tmp), "bytes": os.path.getsize(tmp)}
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)
    return record


def save_data_file(directory: str, name: str, obj: Dict[str, Any]) -> Dict[str, Any]:
    """``torch.save`` ``obj`` (a dict; the format version is added) atomically; its record."""
    payload = {"format_version": FORMAT_VERSION, **obj}
    return _write_atomic(directory, name, lambda f: torch.save(payload, f))


def write_metadata(directory: str, metadata: Dict[str, Any]) -> None:
    """Commit a save: atomically replace ``checkpoint.json`` ([Note: checkpoint directory])."""
    text = json.dumps({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **metadata})
    _write_atomic(directory, METADATA_FILE, lambda f: f.write(text.encode()))


def read_metadata(directory: str) -> Dict[str, Any]:
    """The metadata of the checkpoint in ``directory``; CheckpointError if unusable."""
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at '{directory}': {METADATA_FILE} is missing")
    try:
        with open(path, "rb") as f:
            metadata = json.loads(f.read().decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"'{path}' is truncated or corrupted (not valid JSON: {exc})")
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        raise CheckpointError(f"'{path}' is not a tiny_fsdp checkpoint (no '{FORMAT_NAME}' tag)")
    _check_version(metadata.get("format_version"), path)
    return metadata


def _check_version(version: Any, path: str) -> None:
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"'{path}' has checkpoint format version {version!r}, but this tiny_fsdp reads "
            f"version {FORMAT_VERSION}; load it with the tiny_fsdp version that wrote it"
        )


def remove_stale_files(directory: str, keep: Set[str]) -> None:
    """Delete the data files (and leftover temporaries) of earlier saves not in ``keep``."""
    for name in os.listdir(directory):
        ours = name.startswith(DATA_PREFIXES) or (name.startswith(".") and _TMP_MARK in name)
        if ours and name not in keep and name != METADATA_FILE:
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def remove_files(directory: str, names: List[str]) -> None:
    for name in names:
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


class CheckpointReader:
    """Reads the pieces of a checkpoint, opening (and verifying) only the files it needs.

    ``read_into(tid, start, stop, out)`` fills ``out`` (``stop - start`` elements, contiguous)
    with flat elements ``[start, stop)`` of tensor ``tid`` from the pieces that overlap them.
    Files are memory-mapped, so only the bytes of those pieces are read into memory (after the
    checksum pass over the file). ``files_read`` lists the data files opened, in order.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.metadata = read_metadata(directory)
        self.tensors: Dict[str, Dict[str, Any]] = self.metadata["tensors"]
        self.scalar_locations: Dict[str, Dict[str, list]] = self.metadata["scalars"]
        self.files_read: List[str] = []
        self._open: Dict[str, Any] = {}

    def get(self, location: list) -> Any:
        """The object at ``[file, [key, key, ...]]`` inside a data file."""
        name, path = location
        obj = self._load(name)
        for key in path:
            obj = obj[key]
        return obj

    def _load(self, name: str) -> Any:
        if name not in self._open:
            record = self.metadata["files"].get(name)
            path = os.path.join(self.directory, name)
            if record is None or not os.path.isfile(path):
                raise CheckpointError(f"checkpoint file '{path}' is missing")
            size = os.path.getsize(path)
            if size != record["bytes"]:
                raise CheckpointError(
                    f"checkpoint file '{path}' is truncated or damaged: {size} bytes, the "
                    f"metadata says {record['bytes']}"
                )
            if sha256_file(path) != record["sha256"]:
                raise CheckpointError(
                    f"checkpoint file '{path}' is corrupted: its sha256 checksum differs from "
                    "the one recorded when it was saved"
                )
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # checksum ok, yet unreadable: not our format
                raise CheckpointError(f"cannot read checkpoint file '{path}': {exc}") from exc
            _check_version(obj.get("format_version") if isinstance(obj, dict) else None, path)
            self._open[name] = obj
            self.files_read.append(name)
        return self._open[name]

    def has(self, tid: str) -> bool:
        return tid in self.tensors

    def shape(self, tid: str) -> tuple:
        return tuple(self.tensors[tid]["shape"])

    def dtype(self, tid: str) -> torch.dtype:
        return getattr(torch, self.tensors[tid]["dtype"].replace("torch.", ""))

    def read_into(self, tid: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Row-major elements ``[start, stop)`` of ``tid`` into ``out``, whatever its strides (a
        transposed or ``channels_last`` parameter is filled through a contiguous copy)."""
        if out.numel() != stop - start:
            raise ValueError(f"read_into needs a tensor of {stop - start} elements")
        target = (
            out
            if out.is_contiguous()
            else torch.empty_like(out, memory_format=torch.contiguous_format)
        )
        flat = target.view(-1)
        covered = 0
        for name, path, lo, hi in self.tensors[tid]["pieces"]:
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                source = self.get([name, path]).reshape(-1)
                flat[a - start : b - start].copy_(source[a - lo : b - lo])
                covered += b - a
        if covered != stop - start:  # pieces are disjoint (checked at save): a hole
            raise CheckpointError(
                f"checkpoint '{self.directory}' lacks elements [{start}, {stop}) of '{tid}' "
                f"(found {covered} of {stop - start})"
            )
        if target is not out:
            out.copy_(target)

    def scalars(self, name: str) -> Dict[str, Any]:
        """The scalar optimizer state of parameter ``name`` (e.g. AdamW's ``step``).

        Every rank that held part of the parameter saved a copy; read one from a file already
        open if possible, so that no file is opened for a scalar alone.
        """
        out = {}
        for key, copies in self.scalar_locations.get(name, {}).items():
            out[key] = self.get(next((c for c in copies if c[0] in self._open), copies[0]))
        return out

    def state_keys(self, name: str) -> List[str]:
        """Elementwise optimizer state keys saved for parameter ``name``."""
        prefix = f"optim/{name}/"
        return [tid[len(prefix) :] for tid in self.tensors if tid.startswith(prefix)]

    def optional(self, field: str) -> Optional[Any]:
        """``extra``, ``param_groups`` or ``rng`` (a list by rank), via the metadata."""
        location = self.metadata.get("locations", {}).get(field)
        return None if location is None else self.get(location)
