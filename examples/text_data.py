"""Byte-level text data for the training example: the Python standard library's own sources.

Every machine with Python has this corpus, so the example needs no download. The pipeline:

1. :func:`load_corpus` lists the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` in
   sorted (relative POSIX path) order, skipping ``site-packages`` (not the standard library),
   assigns each file to the train or held-out split by a hash of its path (:func:`is_heldout`),
   and reads each split's files in order up to its share of ``max_bytes``.
2. :func:`pack_documents` turns the documents (one file = one document, one byte = one token,
   vocabulary 256) into rows of ``seq_len`` tokens by concatenating them and cutting the stream
   into rows ("packing with splitting", as in T5/seqio). Each row carries ``segment_ids``
   (1, 2, ... per document piece in the row, 0 for padding) and ``positions`` that restart at 0
   at every piece, so a document cut at a row end continues in the next row as a new segment.
3. :func:`next_token_targets` gives the shifted targets and a loss mask that is 0 where the next
   token belongs to another segment, is padding, or lies beyond the row.
4. :class:`RowSampler` draws batches from a seeded permutation per epoch as a pure function of
   the number of rows already consumed, which is all a checkpoint needs to resume the stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Sequence

import numpy as np

VOCAB_SIZE = 256  # one token per byte
PAD_SEGMENT_ID = 0  # segment id of padding positions
EXCLUDED_DIRS = ("site-packages", "__pycache__")


def stdlib_root() -> pathlib.Path:
    """The directory of the running interpreter's standard library sources."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: str | pathlib.Path) -> list[str]:
    """Relative POSIX paths of the ``*.py`` files under ``root``, sorted, without third-party dirs.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    root = pathlib.Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"root={str(root)!r} is not a directory")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune, do not descend
        rel_dir = pathlib.Path(dirpath).relative_to(root)
        paths.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(paths)


def is_heldout(relpath: str, heldout_fraction: float) -> bool:
    """Whether a file belongs to the held-out split: SHA-256 of its relative path, as a fraction.

    The decision depends on the path alone (not on the other files or on the corpus cap), so it is
    the same on every machine and for every ``max_bytes``.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < heldout_fraction


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents of the two splits in sorted path order; ``*_docs[i]`` is file ``*_paths[i]``."""

    root: str
    train_paths: tuple[str, ...]
    train_docs: tuple[bytes, ...]
    heldout_paths: tuple[str, ...]
    heldout_docs: tuple[bytes, ...]

    @property
    def num_bytes(self) -> int:
        return sum(map(len, self.train_docs)) + sum(map(len, self.heldout_docs))


def load_corpus(
    root: str | pathlib.Path | None = None,
    *,
    max_bytes: int,
    heldout_fraction: float = 0.05,
) -> Corpus:
    """Reads the first ``max_bytes`` of source files (sorted order) and splits them by path hash.

    Each split takes its files whole, in sorted order, while its total stays within its share of
    ``max_bytes`` (``heldout_fraction`` of it for the held-out split, the rest for training; the
    first file of a split is always taken); empty files are skipped. Both splits are therefore
    prefixes (in sorted order) of their full splits.

    Args:
        root: directory to read; default :func:`stdlib_root`.
        max_bytes: cap on the bytes read, > 0.
        heldout_fraction: fraction of files (by path hash) in the held-out split, in (0, 1).

    Raises:
        ValueError: ``max_bytes <= 0``, a bad ``heldout_fraction``, or a split ends up empty
            (raise ``max_bytes`` or change ``heldout_fraction``).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    root = pathlib.Path(root) if root is not None else stdlib_root()
    budget = {True: heldout_fraction * max_bytes, False: (1.0 - heldout_fraction) * max_bytes}
    split: dict[bool, tuple[list[str], list[bytes]]] = {False: ([], []), True: ([], [])}
    used = {False: 0, True: 0}
    full = {False: False, True: False}
    for rel in list_source_files(root):
        heldout = is_heldout(rel, heldout_fraction)
        if full[heldout]:
            if all(full.values()):
                break
            continue
        data = (root / rel).read_bytes()
        if not data:
            continue
        if used[heldout] and used[heldout] + len(data) > budget[heldout]:
            full[heldout] = True
            continue
        used[heldout] += len(data)
        paths, docs = split[heldout]
        paths.append(rel)
        docs.append(data)
    for name, heldout in (("train", False), ("held-out", True)):
        if not split[heldout][0]:
            raise ValueError(
                f"the {name} split is empty with max_bytes={max_bytes} and "
                f"heldout_fraction={heldout_fraction}; raise max_bytes")
    return Corpus(str(root), tuple(split[False][0]), tuple(split[False][1]),
                                tuple(split[True][0]), tuple(split[True][1]))


def encode(data: bytes) -> np.ndarray:
    """Bytes -> ``int32`` token ids in [0, 256)."""
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(tokens) -> bytes:
    """Token ids in [0, 256) -> bytes. Raises ValueError for ids outside that range."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= VOCAB_SIZE):
        raise ValueError(
            f"tokens must lie in [0, {VOCAB_SIZE}), got [{tokens.min()}, {tokens.max()}]")
    return tokens.astype(np.uint8).tobytes()


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Packed rows, all ``[num_rows, seq_len] int32``.

    ``tokens`` are byte ids (0 at padding); ``segment_ids`` number the document pieces of a row
    1, 2, ... (0 = padding); ``positions`` count from 0 within each piece (0 at padding).
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    def __len__(self) -> int:
        return self.tokens.shape[0]


def pack_documents(docs: Sequence[bytes], seq_len: int) -> PackedRows:
    """Concatenates documents and cuts the stream into rows of ``seq_len`` tokens.

    No token is dropped: a document that crosses a row end continues at the start of the next row
    as a new segment (positions restart at 0 there). Only the last row is padded.

    Raises:
        ValueError: ``seq_len < 2`` or no non-empty document.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError("docs holds no non-empty document")
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    total = int(lengths.sum())
    num_rows = -(-total // seq_len)
    size = num_rows * seq_len
    flat_tokens = np.zeros(size, np.int32)
    flat_tokens[:total] = encode(b"".join(docs))
    # A piece starts at every document start and at every row start.
    starts = np.zeros(size, bool)
    starts[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
    starts[::seq_len] = True
    starts[total:] = False
    piece = np.cumsum(starts)  # global piece number, 1-based, over the real tokens
    index = np.arange(size)
    piece_start = np.maximum.accumulate(np.where(starts, index, 0))
    flat_positions = np.where(index < total, index - piece_start, 0)
    # Renumber pieces from 1 inside each row.
    first_piece_of_row = piece[::seq_len]
    flat_segments = piece - np.repeat(first_piece_of_row, seq_len) + 1
    flat_segments[total:] = PAD_SEGMENT_ID
    shape = (num_rows, seq_len)
    return PackedRows(flat_tokens.reshape(shape), flat_segments.astype(np.int32).reshape(shape),
                                        flat_positions.astype(np.int32).reshape(shape))


def next_token_targets(tokens: np.ndarray, segment_ids: np.ndarray):
    """Targets ``tokens[..., t + 1]`` and a float32 mask of the positions that have one.

    ``mask[..., t] = 1`` iff ``t + 1 < seq_len``, position ``t`` is not padding, and ``t + 1``
    is in the same segment (so no loss across a document boundary or into padding).

    Returns:
        ``(targets int32, mask float32)``, both of ``tokens``' shape.
    """
    tokens = np.asarray(tokens)
    segment_ids = np.asarray(segment_ids)
    targets = np.zeros_like(tokens, dtype=np.int32)
    targets[..., :-1] = tokens[..., 1:]
    mask = np.zeros(tokens.shape, np.float32)
    current, following = segment_ids[..., :-1], segment_ids[..., 1:]
    mask[..., :-1] = (following == current) & (current != PAD_SEGMENT_ID)
    return targets, mask


def make_batch(rows: PackedRows, index: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``index`` as a batch: ``tokens, segment_ids, positions, targets, loss_mask``."""
    tokens = rows.tokens[index]
    segment_ids = rows.segment_ids[index]
    targets, mask = next_token_targets(tokens, segment_ids)
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": rows.positions[index],
                    "targets": targets, "loss_mask": mask}


class RowSampler:
    """Deterministic batches of row indices: epoch ``e`` visits the rows in a permutation seeded by
    ``(seed, e)``. The stream is a pure function of ``position`` (rows consumed so far), so saving
    ``position`` in a checkpoint is enough to resume it exactly.
    """

    def __init__(self, num_rows: int, *, seed: int, shuffle: bool = True):
        if num_rows <= 0:
            raise ValueError(f"num_rows must be > 0, got {num_rows}")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._perms[epoch] = rng.permutation(self.num_rows)
            else:
                self._perms[epoch] = np.arange(self.num_rows)
        return self._perms[epoch]

    def indices(self, position: int, batch_size: int) -> np.ndarray:
        """Row indices of the ``batch_size`` rows starting at stream position ``position``."""
        if position < 0 or batch_size <= 0:
            raise ValueError(f"need position >= 0 and batch_size > 0, got {position}, {batch_size}")
        k = np.arange(position, position + batch_size)
        epochs, offsets = np.divmod(k, self.num_rows)
        return np.array([self._perm(int(e))[o] for e, o in zip(epochs, offsets)], dtype=np.int64)
