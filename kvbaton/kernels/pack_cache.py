"""Packed weight layouts kept on disk: computed once per (model, compute plan, kernels), mapped at every later start.

Packing a model's weights for the C GEMMs (the AVX2 row's panels, the AMX row's tiles) costs a worker seconds of
its start (2.2 s for the default model's AVX2 panels, measured on a 2-core EPYC) and gives the same bytes every
time. So the first start writes what it packed to one file, and later starts map it instead of packing:

    <cache root>/packed/<model dir name>-<key digest>.kvpack

keyed by what the bytes are made from (`pack_key`): the checkpoint's files as the file system describes them (name,
size, modification time: no re-hash of the weights at start), the compute plan, the packing code's version and
the kernels' sources. A file is used only if it is ours (owned by this user, not writable by group or others),
its length is what its header says, its key is this key and its data's CRC32 matches (~0.1 s for 0.5 GB); else
it is rebuilt, never used. It is written to a temporary file and renamed, so a concurrent start never reads half
of one. Layout (all offsets 64-byte aligned, as the kernels' loads want):

    b"KVPACK01" | header length (8 bytes, little-endian) | header JSON | padding | tensor data ...
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import stat
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from kvbaton.paths import cache_root

log = logging.getLogger(__name__)

PACK_CACHE_ENV = "KVBATON_PACK_CACHE"  # 0: pack at every start, keep nothing
MAGIC = b"KVPACK01"
# NOTE: bump when a packing function changes the bytes it makes (the kernels' sources are keyed besides)
PACKING_VERSION = "1"
ALIGN = 64
MAX_CACHE_BYTES = 4 * 2**30  # all packed files of a machine together (oldest removed first)
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8, "uint8": torch.uint8}


def pack_key(model_dir: Path, plan: str, kernels: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What packed bytes are made from: the checkpoint's weight files and config as stat() gives them, the compute
    plan (its summary), the kernels' build digest and the packing version; `extra`: anything else they depend on."""
    files = sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"])
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return {"model": str(model_dir.resolve()), "files": json.dumps(stats), "plan": plan, "kernels": kernels,
            "packing": PACKING_VERSION, "torch": torch.__version__, **(extra or {})}


class PackCache:
    """One model's packed weights under one key. `get(name, make)` gives the cached tensor or makes (and keeps) it;
    `save()` writes the file when anything was made. Tensors read from the file are copy-on-write mappings: workers
    of one machine share their pages."""

    def __init__(self, path: Path, key: dict[str, str]) -> None:
        self.path = path
        self.key = key
        self._loaded = self._load()
        self._made: dict[str, torch.Tensor] = {}

    @classmethod
    def for_model(cls, model_dir: Path, key: dict[str, str]) -> PackCache:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return cls(cache_root() / "packed" / f"{model_dir.name}-{digest}.kvpack", key)

    @property
    def hits(self) -> int:
        return len(self._loaded)

    def get(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        tensor = self._loaded.get(name)
        if tensor is None:
            tensor = self._made[name] = make().contiguous()
        return tensor

    def save(self) -> None:
        """Write every packed tensor (those read and those made) when any was made; a failure only logs: the
        packed weights in memory are right, the next start packs again."""
        if not self._made:
            return
        try:
            _write(self.path, self.key, {**self._loaded, **self._made})
        except OSError as exc:
            log.warning("could not keep the packed weights in %s (the next start packs again): %s", self.path, exc)
            return
        log.info("kept %d packed weights in %s", len(self._made) + len(self._loaded), self.path)
        prune(self.path.parent, keep=self.path)

    def _load(self) -> dict[str, torch.Tensor]:
        try:
            return _read(self.path, self.key)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("packed weights in %s not used, packing again: %s", self.path, exc)
            return {}


def prune(folder: Path, keep: Path, max_bytes: int = MAX_CACHE_BYTES) -> None:
    """Remove the least recently written files of `folder` until it holds at most `max_bytes` (`keep` stays):
    every model and plan a machine ever ran (each test's random checkpoint too) would otherwise stay for good."""
    sized = []
    for f in folder.glob("*.kvpack"):
        try:
            st = f.stat()
        except OSError:
            continue  # NOTE: another process pruned it just now
        sized.append((st.st_mtime, st.st_size, f))
    total = 0
    for _, size, f in sorted(sized, key=lambda entry: (entry[2] != keep, -entry[0])):
        total += size
        if total > max_bytes and f != keep:
            f.unlink(missing_ok=True)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _write(path: Path, key: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    entries: dict[str, dict[str, object]] = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset,
                         "nbytes": nbytes}
        offset = _aligned(offset + nbytes)
    crc = 0
    for chunk in _data_chunks(tensors.values()):
        crc = zlib.crc32(chunk, crc)
    header = json.dumps({"key": key, "tensors": entries, "data_bytes": offset, "crc32": crc}).encode()
    prefix = len(MAGIC) + 8
    header += b" " * (_aligned(prefix + len(header)) - prefix - len(header))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header)
            for chunk in _data_chunks(tensors.values()):
                f.write(chunk)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _data_chunks(tensors: Iterable[torch.Tensor]) -> Iterator[memoryview | bytes]:
    """The data section piece by piece: each tensor's bytes where they lie, then zeros to the next aligned offset.
    NOTE: never the whole section in one buffer: for the AVX2 row's fp32 panels (0.5 GB for the default model) a
    bytearray of it and a `tobytes()` copy of each tensor raised a first start's peak RSS by ~0.65 GB."""
    for t in tensors:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        yield flat.numpy().data
        pad = _aligned(flat.numel()) - flat.numel()
        if pad:
            yield bytes(pad)


def _read(path: Path, key: dict[str, str]) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValueError("the file is not this user's own, or others may write it")
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a packed-weights file")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > min(st.st_size, 64 * 2**20):
            raise ValueError("its header length is out of bounds")
        header = json.loads(f.read(header_len))
        start = len(MAGIC) + 8 + header_len
        if st.st_size != start + header["data_bytes"]:
            raise ValueError(f"{st.st_size} bytes, its header says {start + header['data_bytes']}")
        if header["key"] != key:
            raise ValueError("made from other weights, another compute plan or other kernels")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: nothing is ever written back
    view = memoryview(mapped)[start:]
    if zlib.crc32(view) != header["crc32"]:
        raise ValueError("its data fails its CRC")
    out = {}
    for name, e in header["tensors"].items():
        if e["offset"] + e["nbytes"] > header["data_bytes"] or e["dtype"] not in _DTYPES:
            raise ValueError(f"entry {name!r} is malformed")
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=e["nbytes"], offset=start + e["offset"])
        out[name] = raw.view(_DTYPES[e["dtype"]]).view(e["shape"])
    return out
