"""Reading and writing safetensors checkpoint directories, one tensor (or slice) at a time.

A checkpoint directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: key -> file), as written by transformers'
``save_pretrained``. Tensors are read with ``safetensors.safe_open`` (memory-mapped: a slice
reads only its bytes). FP8 tensors (``F8_E4M3`` / ``F8_E5M2`` / ``F8_E8M0``), which safetensors
cannot hand to NumPy, are memory-mapped from the file's own header offsets (format:
https://github.com/huggingface/safetensors, "Format") with the ``ml_dtypes`` element types that
jax exports.
"""

from __future__ import annotations

import glob
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_RAW_DTYPES = {
    "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2, "F8_E8M0": jnp.float8_e8m0fnu,
}


def _read_header(file: str) -> tuple[dict, int]:
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class CheckpointReader:
    """Random access to the tensors of a safetensors checkpoint directory.

    Args:
      path: the directory.

    Raises:
      FileNotFoundError: no safetensors file, or an index naming a missing file.
      ValueError: a key stored in two files.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(self.path, SINGLE_FILE)):
            files = [SINGLE_FILE]
        else:
            pattern = os.path.join(self.path, "*.safetensors")
            files = sorted(os.path.basename(f) for f in glob.glob(pattern))
        if not files:
            raise FileNotFoundError(f"CheckpointReader: no *.safetensors file in {self.path!r}")
        self._info: dict[str, tuple[str, str, tuple[int, ...], tuple[int, int], int]] = {}
        for name in files:
            file = os.path.join(self.path, name)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"CheckpointReader: {INDEX_FILE} names missing {file!r}")
            header, base = _read_header(file)
            for key, entry in header.items():
                if key in self._info:
                    raise ValueError(f"CheckpointReader: key {key!r} is stored in two files")
                self._info[key] = (
                    file, entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"]), base
                )
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self._info)

    def __contains__(self, key: str) -> bool:
        return key in self._info

    def file_of(self, key: str) -> str:
        return self._info[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info[key][2]

    def dtype(self, key: str) -> str:
        """The safetensors dtype name (``"BF16"``, ``"F32"``, ``"F8_E4M3"``, ...)."""
        return self._info[key][1]

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor ``key`` (or its ``index`` slice: one ``slice`` per dim) as NumPy, in its
        stored dtype (``ml_dtypes`` for bfloat16 and FP8)."""
        file, dtype, shape, (start, end), base = self._info[key]
        if index is None:
            index = tuple(slice(None) for _ in shape)
        if dtype in _RAW_DTYPES:
            mm = np.memmap(
                file, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,)
            )
            arr = mm.view(_RAW_DTYPES[dtype]).reshape(shape)
            return np.array(arr[index])
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(file, framework="numpy").__enter__()
        if not shape:
            return handle.get_tensor(key)
        return np.asarray(handle.get_slice(key)[index])

    def raw_bytes(self, key: str) -> np.ndarray:
        """The stored bytes of ``key``, memory-mapped as a flat ``uint8`` array (for sub-byte
        dtypes such as ``F4``, two E2M1 codes per byte, whose header shape counts elements)."""
        file, _, _, (start, end), base = self._info[key]
        return np.memmap(file, dtype=np.uint8, mode="r", offset=base + start, shape=(end - start,))

    def close(self):
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"``, ``"200MB"``, ``"64KiB"``.

    Raises:
      ValueError: an unparsable or non-positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        text = str(size).strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9,
                 "B": 1}
        for unit, mult in units.items():
            if text.endswith(unit):
                try:
                    value = int(float(text[: -len(unit)]) * mult)
                except ValueError:
                    raise ValueError(f"parse_size: cannot read {size!r}") from None
                break
        else:
            raise ValueError(f"parse_size: cannot read {size!r} (use e.g. '5GB' or an int)")
    if value <= 0:
        raise ValueError(f"parse_size: size must be positive, got {size!r}")
    return value


def host_array(x) -> np.ndarray:
    """``x`` as a host NumPy array, for writing (``save_hf``).

    Raises:
      ValueError: a ``jax.Array`` not fully addressable from this process (multi-host).
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(
            "save_hf: a parameter is not fully addressable from this process (multi-host); "
            "save from a process that can address every shard"
        )
    return np.asarray(jax.device_get(x))


class CheckpointWriter:
    """Writes tensors in arrival order into shards of at most ``max_shard_size`` bytes (a tensor
    larger than that gets a shard of its own), named and indexed as transformers does.

    Only the current shard is held in host memory. Call :meth:`add` per tensor, then
    :meth:`finish`.
    """

    def __init__(self, path: str | os.PathLike, max_shard_size: int | str = "5GB"):
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.max_shard_size = parse_size(max_shard_size)
        self._shard: dict[str, np.ndarray] = {}
        self._shard_bytes = 0
        self._tmp_files: list[tuple[str, list[str]]] = []
        self._seen: set[str] = set()
        self.total_size = 0

    def add(self, key: str, array: np.ndarray):
        if key in self._seen:
            raise ValueError(f"CheckpointWriter: key {key!r} written twice")
        self._seen.add(key)
        array = np.ascontiguousarray(array)
        if self._shard and self._shard_bytes + array.nbytes > self.max_shard_size:
            self._flush()
        self._shard[key] = array
        self._shard_bytes += array.nbytes
        self.total_size += array.nbytes

    def _flush(self):
        name = os.path.join(self.path, f".tmp-shard-{len(self._tmp_files):05d}.safetensors")
        save_file(self._shard, name, metadata={"format": "pt"})
        self._tmp_files.append((name, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard (and the index when there are several); returns the file names."""
        if self._shard or not self._tmp_files:
            self._flush()
        n = len(self._tmp_files)
        # Files of an earlier checkpoint in the same directory would shadow this one.
        old_shards = glob.glob(os.path.join(self.path, "model-*-of-*.safetensors"))
        for stale in (INDEX_FILE, SINGLE_FILE, *old_shards):
            stale = os.path.join(self.path, stale)
            if os.path.isfile(stale):
                os.remove(stale)
        if n == 1:
            os.replace(self._tmp_files[0][0], os.path.join(self.path, SINGLE_FILE))
            return [SINGLE_FILE]
        names, weight_map = [], {}
        for i, (tmp, keys) in enumerate(self._tmp_files):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.path, name))
            names.append(name)
            weight_map.update({k: name for k in keys})
        with open(os.path.join(self.path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": self.total_size}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
        return names
