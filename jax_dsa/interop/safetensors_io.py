"""Reading and writing safetensors checkpoint directories, one tensor (or slice) at a time.

A checkpoint directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: key -> file), as written by transformers'
``save_pretrained``. Tensors are read with ``safetensors.safe_open`` (memory-mapped: a slice
reads only its bytes). FP8 tensors (``F8_E4M3`` / ``F8_E5M2`` / ``F8_E8M0``), which safetensors
cannot hand to NumPy, are memory-mapped from the file's own header offsets (format:
https://github.com/huggingface/safetensors, "Format") with the ``ml_dtypes`` element types that
jax exports.

Damaged files are refused with the file named: every header is checked against the file's size
before anything is allocated (header length, JSON, each tensor's dtype, shape and byte range).

Crash safety (:class:`CheckpointWriter`): a save writes every file (shards, index,
``config.json``) into a hidden staging folder ``.jax_dsa-save-*`` inside the directory, fsyncs
it, and commits by one atomic rename of a small record, ``.jax_dsa-commit.json``, that names the
new files and the old ones they replace. Only then are the new files renamed into place and the
old ones removed; the record goes last. A reader (:class:`CheckpointReader`,
``read_hf_config``) resolves files through the record while it exists, so at every instant the
directory reads as the whole old checkpoint (before the commit) or the whole new one (after).
The next save or load finishes a committed save that was killed and removes a killed save's
staging folder (a save in progress holds an advisory lock on its staging folder, so it is never
taken for litter).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import struct
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): saves and loads do not coordinate
    fcntl = None

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_RAW_DTYPES = {
    "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2, "F8_E8M0": jnp.float8_e8m0fnu,
}


COMMIT_FILE = ".jax_dsa-commit.json"
STAGING_PREFIX = ".jax_dsa-save-"
_LEGACY_TMP_PREFIX = ".tmp-shard-"  # what saves before the commit record left when killed
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# Bits per element of the safetensors dtypes.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "U16": 16, "I16": 16,
    "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32, "U64": 64, "I64": 64, "F64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


def _damaged(file: str, what: str) -> ValueError:
    return ValueError(f"damaged safetensors file {file}: {what}")


def _read_header(file: str) -> tuple[dict, int]:
    """The tensor entries of a safetensors file's header and the offset of its data, checked
    against the file's size before anything is read or allocated.

    Raises:
      ValueError: a file too short for the 8-byte length, a header length past the end of the
        file, a header that is not a JSON object, or an entry whose dtype, shape or byte range is
        wrong or lies past the end of the file (the message names the file).
    """
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _damaged(file, f"{size} bytes, too short for the 8-byte header length "
                                 "(empty or truncated)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise _damaged(file, f"the header length is {n} bytes but the file holds only "
                                 f"{size - 8} after it (truncated, or not safetensors)")
        if n > MAX_HEADER_BYTES:
            raise _damaged(file, f"the header length {n} exceeds safetensors' limit of "
                                 f"{MAX_HEADER_BYTES} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(file, f"its {n}-byte header is not UTF-8 JSON ({e})") from None
    if not isinstance(header, dict):
        raise _damaged(file, f"its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for key, entry in header.items():
        _check_entry(file, key, entry, data_size)
    return header, 8 + n


def _check_entry(file: str, key: str, entry, data_size: int):
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _damaged(file, f"the header entry of {key!r} is not "
                             "{dtype, shape, data_offsets}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPE_BITS:
        raise _damaged(file, f"{key!r} has dtype {dtype!r}, not a safetensors dtype "
                             f"({', '.join(_DTYPE_BITS)})")
    if (not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise _damaged(file, f"{key!r} has shape {shape!r}, not a list of sizes >= 0")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _damaged(file, f"{key!r} has data_offsets {offsets!r}, not [begin, end] with "
                             "0 <= begin <= end")
    if offsets[1] > data_size:
        raise _damaged(file, f"{key!r} ends at byte {offsets[1]} of the data, which holds only "
                             f"{data_size} bytes (truncated)")
    bits = math.prod(shape) * _DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise _damaged(file, f"{key!r} ({dtype} {tuple(shape)}) needs {bits / 8:g} bytes, its "
                             f"data_offsets span {offsets[1] - offsets[0]}")


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def read_json(file: str, what: str):
    """The JSON in ``file``; a ValueError naming ``what`` and the file when it is not JSON."""
    try:
        with open(file, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"damaged {what} {file}: not UTF-8 JSON ({e})") from None


def read_index(file: str) -> dict[str, str]:
    """The ``weight_map`` (key -> shard file name) of a ``model.safetensors.index.json``.

    Raises:
      ValueError: not JSON, not an object with a ``weight_map`` object of string values, or a
        shard name that is not a plain file name (the message names the file).
    """
    index = read_json(file, "checkpoint index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        got = (f"keys {sorted(index)[:5]}" if isinstance(index, dict)
               else f"a JSON {type(index).__name__}")
        raise ValueError(f"damaged checkpoint index {file}: expected an object with a "
                         f"'weight_map' object, got {got}")
    weight_map = index["weight_map"]
    bad = [(k, v) for k, v in weight_map.items() if not _plain_name(v)]
    if bad:
        raise ValueError(f"damaged checkpoint index {file}: weight_map values must be file "
                         f"names in the directory, got e.g. {bad[:3]}")
    return weight_map


# ----------------------------------------------------------------------------------------------
# The commit record, locks and recovery (module docstring, "Crash safety")


def _flock(fd: int, exclusive: bool, wait: bool, path: str = "") -> bool | None:
    """Takes an advisory lock on ``fd``: True when held, False when busy (``wait=False``), None
    where the file system has no locks."""
    if fcntl is None:
        return None
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        if not wait:
            return False
    except OSError:
        return None
    if exclusive:
        warnings.warn(f"save_hf: waiting for another save into {path} to finish", stacklevel=2)
    fcntl.flock(fd, op)
    return True


@contextlib.contextmanager
def _dir_lock(path: str, exclusive: bool, wait: bool):
    if fcntl is None:  # nothing to lock with (and Windows cannot open a directory)
        yield None
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        yield _flock(fd, exclusive, wait, path)
    finally:
        os.close(fd)  # releases the lock


def _fsync_file(file: str):
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # file systems that cannot sync a directory
        pass
    finally:
        os.close(fd)


def _write_synced(file: str, text: str):
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _read_commit(path: str) -> dict | None:
    """The commit record of a save that has not finished moving its files into place, or
    None."""
    file = os.path.join(path, COMMIT_FILE)
    if not os.path.isfile(file):
        return None
    record = read_json(file, "save_hf commit record")
    ok = (isinstance(record, dict)
          and isinstance(record.get("staging"), str)
          and record["staging"].startswith(STAGING_PREFIX) and _plain_name(record["staging"])
          and isinstance(record.get("files"), dict)
          and all(_plain_name(k) and _plain_name(v) for k, v in record["files"].items())
          and isinstance(record.get("remove"), list)
          and all(_plain_name(k) for k in record["remove"]))
    if not ok:
        raise ValueError(
            f"damaged save_hf commit record {file}: expected {{staging, files, remove}} naming "
            f"files of {path}; the save it records cannot be completed (move the record away to "
            "read the files in place)")
    return record


def _roll_forward(path: str, record: dict):
    """Moves a committed save's files into place and removes the files it replaces."""
    staging = os.path.join(path, record["staging"])
    for name, staged in record["files"].items():
        src = os.path.join(staging, staged)
        if os.path.exists(src):
            os.replace(src, os.path.join(path, name))
    for name in record["remove"]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, name))
    _fsync_dir(path)
    shutil.rmtree(staging, ignore_errors=True)
    os.remove(os.path.join(path, COMMIT_FILE))
    _fsync_dir(path)


def _recover(path: str, locks: bool = True):
    """Finishes a killed save that had committed; removes the staging folders of killed saves
    (``locks``: only with advisory locks can a killed save's folder be told from a live one's).
    The caller holds the directory's exclusive lock."""
    record = _read_commit(path)
    if record is not None:
        _roll_forward(path, record)
    for entry in os.scandir(path):
        name = entry.name
        if name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False) and locks:
            with _dir_lock(entry.path, exclusive=True, wait=False) as idle:
                if idle:  # no save holds it: a killed one's
                    shutil.rmtree(entry.path, ignore_errors=True)
        elif name == COMMIT_FILE + ".tmp" or (
                name.startswith(_LEGACY_TMP_PREFIX) and name.endswith(".safetensors")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(entry.path)


def prepare_read(path: str | os.PathLike):
    """Called before reading a checkpoint directory: when no save is committing there, finishes
    or clears what a killed save left (best effort: on a read-only directory the files are read
    through the commit record instead); when one is, waits for it to end."""
    path = os.fspath(path)
    if fcntl is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        held = _flock(fd, exclusive=True, wait=False)
        if held:
            with contextlib.suppress(OSError):
                _recover(path)
        elif held is False:
            _flock(fd, exclusive=False, wait=True)  # a save is committing: read after it
    finally:
        os.close(fd)


def committed_file(path: str | os.PathLike, name: str, record: dict | None = None) -> str | None:
    """The file that holds ``name`` (e.g. ``"config.json"``) of the checkpoint in ``path``:
    while a committed save is still moving its files into place, the new file (in its staging
    folder or already in place); else ``path/name``. None when the checkpoint has no such file.
    """
    path = os.fspath(path)
    if record is None:
        record = _read_commit(path)
    if record is not None:
        if name in record["files"]:
            staged = os.path.join(path, record["staging"], record["files"][name])
            return staged if os.path.isfile(staged) else os.path.join(path, name)
        if name in record["remove"]:
            return None
    file = os.path.join(path, name)
    return file if os.path.isfile(file) else None


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
        prepare_read(self.path)
        record = _read_commit(self.path) if os.path.isdir(self.path) else None
        index = committed_file(self.path, INDEX_FILE, record)
        single = committed_file(self.path, SINGLE_FILE, record)
        expected: dict[str, str] | None = None
        if index is not None:
            weight_map = read_index(index)
            file_of = {}
            for name in sorted(set(weight_map.values())):
                file_of[name] = committed_file(self.path, name, record)
                if file_of[name] is None:
                    raise FileNotFoundError(
                        f"CheckpointReader: {index} names {name!r}, which is not in {self.path}")
            files = list(file_of.values())
            expected = {k: file_of[v] for k, v in weight_map.items()}
        elif single is not None:
            files = [single]
        else:
            pattern = os.path.join(glob.escape(self.path), "*.safetensors")
            removed = set(record["remove"]) if record else set()
            files = sorted(f for f in glob.glob(pattern) if os.path.basename(f) not in removed)
        if not files:
            raise FileNotFoundError(f"CheckpointReader: no *.safetensors file in {self.path!r}")
        self._info: dict[str, tuple[str, str, tuple[int, ...], tuple[int, int], int]] = {}
        for file in files:
            header, base = _read_header(file)
            for key, entry in header.items():
                if key in self._info:
                    raise ValueError(
                        f"CheckpointReader: key {key!r} is stored in two files, "
                        f"{self._info[key][0]} and {file}")
                self._info[key] = (
                    file, entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"]), base
                )
        if expected is not None:
            lost = [(k, os.path.basename(f)) for k, f in expected.items()
                    if k not in self._info or self._info[k][0] != f]
            if lost:
                raise ValueError(
                    f"CheckpointReader: {index} lists {len(lost)} tensors that are not in the "
                    f"files it names, e.g. {lost[:3]}")
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


def tied_lm_head(model) -> bool:
    """Whether ``save_hf`` leaves ``lm_head`` out (``config.tie_word_embeddings``; transformers
    ties it to the embedding on load).

    Raises:
      ValueError: ``tie_word_embeddings`` with an ``lm_head`` that differs from the embedding.
    """
    if not model.config.tie_word_embeddings:
        return False
    if not np.array_equal(host_array(model.lm_head.weight[...]),
                          host_array(model.embed_tokens.weight[...])):
        raise ValueError(
            "save_hf: tie_word_embeddings is set but lm_head differs from embed_tokens "
            "(transformers would tie them); set tie_word_embeddings=False in the config"
        )
    return True


class CheckpointWriter:
    """Writes tensors in arrival order into shards of at most ``max_shard_size`` bytes (a tensor
    larger than that gets a shard of its own), named and indexed as transformers does.

    Only the current shard is held in host memory. Call :meth:`add` per tensor, then
    :meth:`finish` (or :meth:`abort`). The files are written into a staging folder inside
    ``path`` and replace an earlier checkpoint there atomically (module docstring, "Crash
    safety"): until :meth:`finish` commits, readers see the earlier checkpoint whole; after, the
    new one whole.
    """

    def __init__(self, path: str | os.PathLike, max_shard_size: int | str = "5GB"):
        self.path = os.fspath(path)
        self.max_shard_size = parse_size(max_shard_size)
        os.makedirs(self.path, exist_ok=True)
        self._shard: dict[str, np.ndarray] = {}
        self._shard_bytes = 0
        self._parts: list[tuple[str, list[str]]] = []  # (staged file name, keys)
        self._seen: set[str] = set()
        self._committed = False
        self.total_size = 0
        # Under the directory's lock, so that no recovery takes the new folder for a killed
        # save's before this save locks it.
        with _dir_lock(self.path, exclusive=True, wait=True) as held:
            _recover(self.path, locks=held is not None)
            self._staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path)
            self._staging_fd = None
            if fcntl is not None:  # held while this save lives
                self._staging_fd = os.open(self._staging, os.O_RDONLY)
                _flock(self._staging_fd, exclusive=True, wait=False)

    def add(self, key: str, array: np.ndarray):
        if self._staging is None:
            raise RuntimeError("CheckpointWriter: add() after finish() or abort()")
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
        name = f"part-{len(self._parts):05d}.safetensors"
        file = os.path.join(self._staging, name)
        save_file(self._shard, file, metadata={"format": "pt"})
        _fsync_file(file)
        self._parts.append((name, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0

    def _replaced(self, new: set[str]) -> list[str]:
        """The files of the checkpoint in place that the new one does not overwrite."""
        old = {INDEX_FILE, SINGLE_FILE}
        old.update(os.path.basename(f) for f in
                   glob.glob(os.path.join(glob.escape(self.path), "model-*-of-*.safetensors")))
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index):
            with contextlib.suppress(ValueError, OSError):  # a damaged index: its files stay
                old.update(v for v in read_index(index).values() if v.endswith(".safetensors"))
        return sorted(n for n in old - new if os.path.isfile(os.path.join(self.path, n)))

    def finish(self, config: dict | None = None) -> list[str]:
        """Write the last shard, the index when there are several and ``config`` (as
        ``config.json``, if given), then commit them in place of an earlier checkpoint; returns
        the safetensors file names."""
        if self._staging is None:
            raise RuntimeError("CheckpointWriter: finish() after finish() or abort()")
        try:
            if self._shard or not self._parts:
                self._flush()
            n = len(self._parts)
            files: dict[str, str] = {}  # name in place -> name in the staging folder
            if n == 1:
                files[SINGLE_FILE] = self._parts[0][0]
            else:
                weight_map = {}
                for i, (staged, keys) in enumerate(self._parts):
                    name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                    files[name] = staged
                    weight_map.update({k: name for k in keys})
                _write_synced(os.path.join(self._staging, INDEX_FILE), json.dumps(
                    {"metadata": {"total_size": self.total_size}, "weight_map": weight_map},
                    indent=2, sort_keys=True))
                files[INDEX_FILE] = INDEX_FILE
            names = [f for f in files if f != INDEX_FILE]
            if config is not None:
                _write_synced(os.path.join(self._staging, "config.json"),
                              json.dumps(config, indent=2, sort_keys=True))
                files["config.json"] = "config.json"
            _fsync_dir(self._staging)
            with _dir_lock(self.path, exclusive=True, wait=True) as held:
                _recover(self.path, locks=held is not None)  # a killed save's commit first
                record = {"staging": os.path.basename(self._staging), "files": files,
                          "remove": self._replaced(set(files))}
                tmp = os.path.join(self.path, COMMIT_FILE + ".tmp")
                _write_synced(tmp, json.dumps(record, indent=1))
                os.replace(tmp, os.path.join(self.path, COMMIT_FILE))  # the commit
                self._committed = True
                _fsync_dir(self.path)
                _roll_forward(self.path, record)
        except BaseException:
            self.abort()
            raise
        self._release()
        return names

    def _release(self):
        if self._staging is not None:
            if self._staging_fd is not None:
                os.close(self._staging_fd)
            self._staging = None

    def abort(self):
        """Drop what this writer wrote (nothing once :meth:`finish` has committed: the next
        save or load completes a commit that could not finish)."""
        if self._staging is None:
            return
        staging = self._staging
        self._release()
        if not self._committed:
            shutil.rmtree(staging, ignore_errors=True)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.abort()
