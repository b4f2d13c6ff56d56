"""Layout-invariant training data from a real text corpus that needs no download.

What it is for: the fixed-global-batch contract for users' loops wrapped by the ``Manager``
(DESIGN.md, "Global batch is invariant")::

    for batch in micro_batches(corpus, step, global_batch=G, dp_rank=r, dp_size=d,
                               micro_batch_size=m, seed=s):
        (loss_fn(model(batch.inputs), batch.labels) * batch.weight).backward()

The samples of a step depend only on ``(step, global_batch, seed, corpus)``; the data-parallel
width only decides which rank computes which of them (``dp_size`` must divide ``global_batch``, so
every rank runs the same number of equal micro-batches and no collective waits on a rank with
fewer). A run that rescales at any step boundary
therefore sees exactly the tokens a never-rescaled run sees, and resumes from the step counter
alone.

Three parts, in the order data flows:

1. **Preparation** (:func:`prepare_corpus`, the only part that writes): a byte-level tokenizer
   turns text files into one token file (uint16, little-endian) plus ``meta.json``. Token =
   byte (0..255), and every document ends with the end-of-document token 256, so the
   vocabulary is 257 and a window that spans two files shows the model where one ends. The
   default source is the running Python's standard library (``*.py``, no download needed);
   ``elastic data prepare DIR`` is the command.
2. **Reading** (:class:`TokenCorpus`): a memory map cut into non-overlapping windows of
   ``seq_len + 1`` tokens; sample ``i`` is window ``i``.
3. **Schedule** (:func:`step_samples`, :func:`rank_micro_batches`, pure; :func:`micro_batches`
   reads the map): which samples a step trains on, which rank computes which, and the weight
   that makes the data-parallel reducer produce the gradient of the global-batch mean loss.

Must not: keep an iterator position (callers ask by step), read the clock, shuffle with a
generator whose stream may change between library versions (the permutation is our own
arithmetic), or leave a half-written corpus that opens as valid.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import operator
import os
import platform
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from elastic.model import SpecError

FORMAT = "elastic-token-corpus"
FORMAT_VERSION = 1
TOKENIZER = "bytes+eod"
EOD_TOKEN = 256
VOCAB_SIZE = 257
DTYPE = "uint16-le"
META_FILE = "meta.json"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_SEQ_LEN = 256
# The CPython test suite is larger than the library itself and holds deliberately malformed
# files (bad encodings, syntax errors); installed third-party packages are not the stdlib.
STDLIB_SKIP_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test")

_NP_DTYPE = np.dtype("<u2")
_TOKENS_PREFIX = "tokens-"
_TOKENS_SUFFIX = ".u16"
# mkstemp creates 0600 files; workers that run as another user must still read a shared corpus
_PUBLISHED_MODE = 0o644


class CorpusError(SpecError):
    """A corpus that cannot be prepared or opened; the message names the file and the fix."""


def _int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (numpy ints welcome, bools and floats refused)."""
    if isinstance(value, bool):
        raise SpecError(f"{name}={value!r}: give an integer >= {minimum}")
    try:
        v = operator.index(value)
    except TypeError:
        raise SpecError(f"{name}={value!r}: give an integer >= {minimum}") from None
    if v < minimum:
        raise SpecError(f"{name}={v}: must be >= {minimum}")
    return v


def _fix(directory: Path) -> str:
    return f"re-run `elastic data prepare {directory}`"


def tokens_file_name(sha256: str) -> str:
    """The token file's name: it carries its checksum, so a metadata file and a token file from
    different preparations never pair up by accident."""
    return f"{_TOKENS_PREFIX}{sha256[:16]}{_TOKENS_SUFFIX}"


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusMeta:
    """The contents of ``meta.json``: what the token file holds and how to check it."""

    tokens_file: str
    n_tokens: int
    n_documents: int
    n_source_bytes: int
    sha256: str
    source: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    tokenizer: str = TOKENIZER
    vocab_size: int = VOCAB_SIZE
    eod_token: int = EOD_TOKEN
    dtype: str = DTYPE

    def to_json(self) -> str:
        keys = ("format", "format_version", "tokenizer", "vocab_size", "eod_token", "dtype", "tokens_file",
                "n_tokens", "n_documents", "n_source_bytes", "sha256", "source")
        return json.dumps({k: getattr(self, k) for k in keys}, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: Path) -> CorpusMeta:
        """Validate a parsed ``meta.json``; ``where`` names it in errors."""
        fix = _fix(where.parent)

        def exact_int(key: str) -> Any:
            # JSON true and 1.0 compare equal to 1 in Python; the format says integer
            v = d.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else repr(v)

        if not isinstance(d, dict):
            raise CorpusError(f"{where}: metadata is not a JSON object; {fix}")
        if d.get("format") != FORMAT:
            raise CorpusError(f"{where}: format={d.get('format')!r}, expected {FORMAT!r}: not a token corpus; {fix}")
        if exact_int("format_version") != FORMAT_VERSION:
            raise CorpusError(f"{where}: format_version={d.get('format_version')!r}, this elastic reads "
                              f"{FORMAT_VERSION}; {fix}")
        for key, want in (("tokenizer", TOKENIZER), ("dtype", DTYPE)):
            if d.get(key) != want:
                raise CorpusError(f"{where}: {key}={d.get(key)!r}, expected {want!r}; {fix}")
        for key, want in (("vocab_size", VOCAB_SIZE), ("eod_token", EOD_TOKEN)):
            if exact_int(key) != want:
                raise CorpusError(f"{where}: {key}={d.get(key)!r}, expected {want!r}; {fix}")
        for key in ("n_tokens", "n_documents", "n_source_bytes"):
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CorpusError(f"{where}: {key}={v!r} must be an integer >= 0; {fix}")
        if d["n_documents"] < 1:
            raise CorpusError(f"{where}: n_documents=0: a prepared corpus holds at least one document; {fix}")
        if d["n_tokens"] != d["n_source_bytes"] + d["n_documents"]:
            raise CorpusError(f"{where}: n_tokens={d['n_tokens']}, but one token per source byte plus one "
                              f"end-of-document token per document is {d['n_source_bytes']} + "
                              f"{d['n_documents']} = {d['n_source_bytes'] + d['n_documents']}; {fix}")
        sha = d.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise CorpusError(f"{where}: sha256={sha!r} must be 64 lowercase hex digits; {fix}")
        name = d.get("tokens_file")
        if name != tokens_file_name(sha):
            raise CorpusError(f"{where}: tokens_file={name!r}, but sha256 {sha[:16]}... names "
                              f"{tokens_file_name(sha)!r}; {fix}")
        source = d.get("source", {})
        if not isinstance(source, dict):
            raise CorpusError(f"{where}: source={source!r} must be a JSON object; {fix}")
        return cls(tokens_file=name, n_tokens=d["n_tokens"], n_documents=d["n_documents"],
                   n_source_bytes=d["n_source_bytes"], sha256=sha, source=source)


# --------------------------------------------------------------------------------------------
# 1. Preparation
# --------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """The running Python's standard-library directory (the default source)."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path, pattern: str = "*.py", skip_dirs: Sequence[str] = ()) -> list[Path]:
    """Files under ``root`` whose name matches ``pattern``, in a machine-independent order.

    Order: by the tuple of relative path parts, so the same tree lists the same way on every
    file system. Hidden and ``__pycache__`` directories are always skipped, ``skip_dirs`` by name
    at any depth; directory symlinks are not followed (no cycles, no second copies).
    """
    if root.is_file():
        return [root]
    skip = {"__pycache__", *skip_dirs}
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if fnmatch.fnmatchcase(f, pattern)]
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).parts)


def prepare_corpus(out: str | Path, sources: Sequence[str | Path] | None = None, *, pattern: str = "*.py",
                   max_bytes: int = DEFAULT_MAX_BYTES) -> CorpusMeta:
    """Tokenize text files into the corpus directory ``out`` and return its metadata.

    ``sources``: directories (walked for ``pattern``) or single files, taken in the order given;
    ``None`` means the Python standard library without :data:`STDLIB_SKIP_DIRS`. Empty files
    are skipped (they would add a lone end-of-document token). ``max_bytes`` caps the source
    bytes read: files are taken whole, in order, up to the first one that would pass the cap,
    so a smaller cap gives a prefix of the same corpus. The token file holds
    ``n_source_bytes + n_documents`` tokens, two bytes each.

    Deterministic: the same files give bitwise the same token file, checksum and metadata.
    Crash-safe: the tokens are written to a temporary file, renamed to a name carrying their
    checksum, and only then does ``meta.json`` (also via a temporary file) switch to them, so an
    interrupted run leaves the previous corpus valid, or none. Token files no longer named by
    ``meta.json`` are removed afterwards. Two preparations into one directory at the same time
    are not supported (the later one may remove the other's token file).
    """
    # 1. resolve the sources and list their files
    try:
        max_bytes = _int("max_bytes", max_bytes, 1)
    except SpecError as e:
        raise CorpusError(f"{e} (--max-bytes: the cap on source bytes read)") from None
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CorpusError(f"{out}: exists and is not a directory; choose another output directory")
    files, source = _select_sources(sources, pattern, out)
    # 2. stream the tokens into a temporary file, hashing exactly the bytes written
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CorpusError(f"{out}: cannot create the output directory ({e.strerror}); choose another") from None
    digest, n_docs, n_bytes, stop = hashlib.sha256(), 0, 0, len(files)
    eod = np.array([EOD_TOKEN], dtype=_NP_DTYPE).tobytes()
    fd, tmp_name = tempfile.mkstemp(prefix=".tokens.", suffix=".tmp", dir=out)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            for i, path in enumerate(files):
                data = _read(path)
                if not data:
                    continue
                if n_bytes + len(data) > max_bytes:
                    stop = i
                    break
                chunk = np.frombuffer(data, dtype=np.uint8).astype(_NP_DTYPE).tobytes() + eod
                f.write(chunk)
                digest.update(chunk)
                n_docs, n_bytes = n_docs + 1, n_bytes + len(data)
            f.flush()
            os.fsync(f.fileno())
        if n_docs == 0:
            raise CorpusError(_nothing_fits(files, max_bytes))
        # 3. publish: tokens under their checksum, then the metadata that names them
        sha = digest.hexdigest()
        tokens_name = tokens_file_name(sha)
        os.chmod(tmp, _PUBLISHED_MODE)
        os.replace(tmp, out / tokens_name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # the token file's name must be durable before the metadata that points at it
    _fsync_dir(out)
    # from the file that hit the cap on; empty files are skipped anyway, so they are not left out
    left_out = sum(1 for p in files[stop:] if p.stat().st_size > 0)
    meta = CorpusMeta(tokens_file=tokens_name, n_tokens=n_bytes + n_docs, n_documents=n_docs,
                      n_source_bytes=n_bytes, sha256=sha,
                      source={**source, "max_bytes": max_bytes, "files_left_out": left_out})
    _write_atomic(out / META_FILE, meta.to_json())
    _fsync_dir(out)
    # 4. drop token files of earlier preparations
    for old in out.glob(f"{_TOKENS_PREFIX}*{_TOKENS_SUFFIX}"):
        if old.name != tokens_name:
            old.unlink(missing_ok=True)
    return meta


def _select_sources(sources: Sequence[str | Path] | None, pattern: str,
                    out: Path) -> tuple[list[Path], dict[str, Any]]:
    if not isinstance(pattern, str) or not pattern:
        raise CorpusError(f"pattern={pattern!r}: give a file-name pattern such as '*.py' (--pattern)")
    # with a broad pattern and the output inside a source, an earlier token file would become text
    own = out.resolve()
    if sources is None:
        root = stdlib_root()
        files = [p for p in source_files(root, pattern, STDLIB_SKIP_DIRS) if p.resolve().parent != own]
        if not files:
            raise CorpusError(f"{root}: the standard library has no files matching {pattern!r}; "
                              f"choose others with --pattern, or give --source")
        return files, {"kind": "python-stdlib", "python": platform.python_version(), "roots": [str(root)],
                       "pattern": pattern, "skipped_dirs": list(STDLIB_SKIP_DIRS)}
    if isinstance(sources, str | Path):
        raise CorpusError(f"sources={str(sources)!r}: give a list of directories or files, e.g. [{str(sources)!r}]")
    if not sources:
        raise CorpusError("sources=[]: give at least one directory or file (--source), or None for the "
                          "standard library")
    files: list[Path] = []
    for s in sources:
        root = Path(s)
        if not root.exists():
            raise CorpusError(f"--source {root}: no such file or directory")
        found = [p for p in source_files(root, pattern) if p.resolve().parent != own]
        if not found:
            raise CorpusError(f"--source {root}: no files match {pattern!r}; choose others with --pattern")
        files += found
    return files, {"kind": "files", "roots": [str(Path(s).resolve()) for s in sources], "pattern": pattern}


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise CorpusError(f"--source file {path}: cannot be read ({e.strerror}); fix its permissions or "
                          f"leave it out") from None


def _nothing_fits(files: list[Path], max_bytes: int) -> str:
    first = next((p for p in files if p.stat().st_size > 0), None)
    if first is None:
        return "the sources hold only empty files: no text to tokenize; point --source at text files"
    return (f"max_bytes={max_bytes}: smaller than the first file {first} ({first.stat().st_size} bytes); "
            f"raise --max-bytes to at least that")


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, _PUBLISHED_MODE)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    # the renames are durable only once the directory entry is; not every platform allows it
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# 2. Reading
# --------------------------------------------------------------------------------------------


class TokenCorpus:
    """A prepared corpus as samples: window ``i`` of ``seq_len + 1`` tokens is sample ``i``.

    Windows do not overlap (sample ``i`` starts at token ``i * (seq_len + 1)``); the tail that
    does not fill a window is never used. ``len()`` is the number of samples. Pickles as its
    path (a worker process reopens the map instead of receiving the tokens).
    """

    def __init__(self, directory: Path, meta: CorpusMeta, seq_len: int) -> None:
        self.directory, self.meta, self.seq_len = directory, meta, seq_len
        self.tokens = np.memmap(directory / meta.tokens_file, dtype=_NP_DTYPE, mode="r", shape=(meta.n_tokens,))
        self._n = meta.n_tokens // (seq_len + 1)
        self._windows = self.tokens[: self._n * (seq_len + 1)].reshape(self._n, seq_len + 1)

    @classmethod
    def open(cls, path: str | Path, seq_len: int = DEFAULT_SEQ_LEN, *, verify: bool = False) -> TokenCorpus:
        """Open the corpus directory ``path`` (or its ``meta.json``), checking metadata and size.

        ``verify=True`` also re-hashes the token file against the metadata's checksum (reads it all).
        """
        directory = Path(path)
        if directory.name == META_FILE and directory.is_file():
            directory = directory.parent
        try:
            seq_len = _int("seq_len", seq_len, 1)
        except SpecError as e:
            raise CorpusError(f"{e}: a sample needs at least 1 input token") from None
        meta = read_meta(directory)
        fix = _fix(directory)
        tokens = directory / meta.tokens_file
        if not tokens.is_file():
            raise CorpusError(f"{tokens}: missing (named by {directory / META_FILE}); {fix}")
        size, want = tokens.stat().st_size, meta.n_tokens * _NP_DTYPE.itemsize
        if size != want:
            raise CorpusError(f"{tokens}: {size} bytes, but n_tokens={meta.n_tokens} x 2 bytes = {want}: "
                              f"truncated or from another preparation; {fix}")
        # every document ends with EOD: a file of the right size whose tail was never written
        # (preallocated, or copied in part) ends in zeros instead; one token, no full read
        last = int(np.fromfile(tokens, dtype=_NP_DTYPE, count=1, offset=size - _NP_DTYPE.itemsize)[0])
        if last != EOD_TOKEN:
            raise CorpusError(f"{tokens}: last token {last}, expected the end-of-document token {EOD_TOKEN}: "
                              f"not completely written; {fix}")
        if verify and _sha256_file(tokens) != meta.sha256:
            raise CorpusError(f"{tokens}: content does not match sha256 {meta.sha256[:16]}... in "
                              f"{directory / META_FILE}; {fix}")
        if meta.n_tokens < seq_len + 1:
            raise CorpusError(f"{directory}: {meta.n_tokens} tokens, fewer than one window of seq_len+1 = "
                              f"{seq_len + 1}; use a smaller seq_len or prepare more text")
        return cls(directory, meta, seq_len)

    def __len__(self) -> int:
        return self._n

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenCorpus.open, (self.directory, self.seq_len))

    def __repr__(self) -> str:
        return f"TokenCorpus({str(self.directory)!r}, seq_len={self.seq_len}, samples={self._n})"

    def window(self, index: int) -> np.ndarray:
        """The ``seq_len + 1`` tokens of sample ``index`` (a read-only view of the map)."""
        if not 0 <= index < self._n:
            raise IndexError(f"sample {index} out of range: the corpus has {self._n} at seq_len={self.seq_len}")
        return self._windows[index]

    def samples(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each ``[len(indices), seq_len]`` int64 and contiguous (``labels.view(-1)``
        works): labels are inputs shifted by one."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._n):
            raise IndexError(f"samples {indices!r} out of range 0..{self._n - 1} at seq_len={self.seq_len}")
        rows = self._windows[idx].astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))


def read_meta(directory: str | Path) -> CorpusMeta:
    """Parse and validate ``directory/meta.json`` (no look at the token file)."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not directory.is_dir():
        raise CorpusError(f"{directory}: no such corpus directory; create it with "
                          f"`elastic data prepare {directory}`")
    if not meta_path.is_file():
        raise CorpusError(f"{meta_path}: missing, so {directory} is not a prepared corpus (or its preparation "
                          f"did not finish); run `elastic data prepare {directory}`")
    try:
        raw = json.loads(meta_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CorpusError(f"{meta_path}: cannot be read ({e.strerror}); fix its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorpusError(f"{meta_path}: unreadable metadata ({e}); {_fix(directory)}") from None
    return CorpusMeta.from_dict(raw, meta_path)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# 3. Schedule
# --------------------------------------------------------------------------------------------

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = 0x9E3779B97F4A7C15
_FEISTEL_ROUNDS = 6


def _splitmix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic is exact and version-stable)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    with np.errstate(over="ignore"):
        base = _splitmix(np.array([(seed * _GOLDEN) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        base = _splitmix(base ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
        return [_splitmix(base + np.uint64(r + 1) * np.uint64(_GOLDEN))[0] for r in range(_FEISTEL_ROUNDS)]


def _permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s permutation of ``0..n-1`` at ``positions``, without building it.

    A balanced Feistel network over the smallest even number of bits that covers ``n`` is a
    bijection of ``0..2^bits-1``; cycle-walking (re-applying it until the value falls below
    ``n``) restricts it to a bijection of ``0..n-1``. Since ``2^bits < 4n``, a position needs
    fewer than four passes on average. O(1) memory per position, any corpus size.
    """
    if n == 1:
        return np.zeros_like(positions)
    bits = (n - 1).bit_length()
    bits += bits & 1
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = _round_keys(seed, epoch)
    x = positions.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        v = x[todo]
        left, right = v >> half, v & mask
        with np.errstate(over="ignore"):
            for k in keys:
                left, right = right, left ^ (_splitmix(right + k) & mask)
        v = (left << half) | right
        x[todo] = v
        todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64)


def step_samples(step: int, global_batch: int, n_samples: int, seed: int = 0) -> list[int]:
    """The ``global_batch`` sample indices of ``step``, in order: a pure function of its arguments.

    Steps read the stream of epochs back to back: stream position ``p`` is position
    ``p mod n_samples`` of epoch ``p // n_samples``'s permutation (seeded by ``(seed, epoch)``),
    and step ``s`` takes positions ``s*G .. s*G + G - 1``. A step that crosses an epoch boundary
    continues into the next permutation, so every epoch shows every sample exactly once and
    resuming needs only the step counter. Example: ``n_samples=10, G=4``: step 2 is positions
    8, 9 of epoch 0 and 0, 1 of epoch 1. (Only a ``G`` above ``n_samples`` repeats a sample
    within one step, once per epoch it spans.)
    """
    step = _int("step", step, 0)
    global_batch = _int("global_batch", global_batch, 1)
    seed = _int("seed", seed, -(1 << 63))
    try:
        n_samples = _int("n_samples", n_samples, 1)
    except SpecError as e:
        raise SpecError(f"{e}: the corpus has no sample at this seq_len; use a smaller seq_len or prepare "
                        f"more text") from None
    first = step * global_batch
    out: list[int] = []
    for epoch in range(first // n_samples, (first + global_batch - 1) // n_samples + 1):
        lo = max(first, epoch * n_samples) - epoch * n_samples
        hi = min(first + global_batch, (epoch + 1) * n_samples) - epoch * n_samples
        out += _permute(np.arange(lo, hi, dtype=np.int64), n_samples, seed, epoch).tolist()
    return out


def rank_share(n: int, dp_rank: int, dp_size: int) -> range:
    """Positions of rank ``dp_rank``'s contiguous block of ``n`` items: the first ``n % dp_size``
    ranks take one more (10 over 4 ranks: 3, 3, 2, 2)."""
    _check_rank(dp_rank, dp_size)
    q, r = divmod(n, dp_size)
    start = dp_rank * q + min(dp_rank, r)
    return range(start, start + q + (dp_rank < r))


def micro_batch_count(global_batch: int, dp_size: int, micro_batch_size: int) -> int:
    """Micro-batches (forward/backward passes) every rank runs per step: ``ceil((G / dp) / m)``."""
    global_batch = _int("global_batch", global_batch, 1)
    dp_size = _int("dp_size", dp_size, 1)
    micro_batch_size = _int("micro_batch_size", micro_batch_size, 1)
    _check_divides(global_batch, dp_size)
    return -(-(global_batch // dp_size) // micro_batch_size)


def rank_micro_batches(samples: Sequence[int], dp_rank: int, dp_size: int,
                       micro_batch_size: int) -> list[list[int]]:
    """Rank ``dp_rank``'s micro-batches of a step's ``samples``.

    ``dp_size`` must divide ``len(samples)`` (DESIGN.md: ``dp * micro_batch * grad_accum ==
    global_batch``). The rank's share is its contiguous block of ``G / dp`` samples; the share is
    cut into :func:`micro_batch_count` contiguous pieces of near-equal size (each at most
    ``micro_batch_size``), so every rank runs the same passes of the same sizes and no piece is
    a small remainder: ``G=10, dp=2, m=4`` gives each rank ``[3, 2]``, not ``[4, 1]``.
    """
    pieces = micro_batch_count(len(samples), dp_size, micro_batch_size)
    share = rank_share(len(samples), dp_rank, dp_size)
    mine = list(samples[share.start:share.stop])
    return [mine[p.start:p.stop] for p in (rank_share(len(mine), i, pieces) for i in range(pieces))]


def _check_rank(dp_rank: int, dp_size: int) -> None:
    dp_size = _int("dp_size", dp_size, 1)
    dp_rank = _int("dp_rank", dp_rank, 0)
    if dp_rank >= dp_size:
        raise SpecError(f"dp_rank={dp_rank} must lie in 0..{dp_size - 1} (dp_size={dp_size})")


def _check_divides(global_batch: int, dp_size: int) -> None:
    # an uneven split would give ranks different numbers of backward passes, and a
    # data-parallel reducer that synchronises on each of them would wait forever
    if global_batch % dp_size:
        lo, hi = global_batch // dp_size * dp_size, -(-global_batch // dp_size) * dp_size
        raise SpecError(f"global_batch={global_batch} does not split over dp_size={dp_size} data-parallel ranks "
                        f"({global_batch} % {dp_size} = {global_batch % dp_size}); use a multiple of every "
                        f"allowed dp size, e.g. {lo or dp_size} or {hi}")


class SampleSource(Protocol):
    """What :func:`micro_batches` reads: a sample count and (inputs, labels) by index."""

    def __len__(self) -> int: ...

    def samples(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, eq=False)
class Batch:
    """One micro-batch: ``inputs`` and ``labels`` ``[b, seq_len]`` int64, the global sample ids of
    its rows, and the factor to multiply its mean loss by before ``backward()``."""

    inputs: torch.Tensor
    labels: torch.Tensor
    sample_ids: tuple[int, ...]
    weight: float

    def __len__(self) -> int:
        return len(self.sample_ids)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(self.inputs.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking), self.sample_ids, self.weight)


def micro_batches(corpus: SampleSource, step: int, *, global_batch: int, dp_rank: int, dp_size: int,
                  micro_batch_size: int, seed: int = 0,
                  reduction: Literal["mean", "sum"] = "mean") -> Iterator[Batch]:
    """Rank ``dp_rank``'s micro-batches of ``step`` (see :func:`rank_micro_batches`), with weights.

    The weight makes ``sum over this rank's micro-batches of mean_loss(mb) * weight``, followed
    by the data-parallel gradient reducer, equal to the gradient of the mean loss over the
    whole global batch of ``G`` samples. With ``l_i`` the loss of sample ``i`` (itself a mean
    over its ``seq_len`` tokens; every sample has exactly ``seq_len`` labels, none ignored,
    so a mean over a micro-batch's tokens is the mean of its ``l_i``)::

        mean_loss(mb) = (1 / |mb|) * sum_{i in mb} l_i

    ``reduction="mean"`` (DDP, FSDP2: the reducer averages over the ``dp`` ranks), weight
    ``dp * |mb| / G``::

        (1 / dp) * sum_ranks sum_mb (dp * |mb| / G) * (1 / |mb|) * sum_{i in mb} grad l_i
          = (1 / G) * sum_{i in step} grad l_i

    ``reduction="sum"`` (the reducer adds the ranks' gradients), weight ``|mb| / G``: the same
    sum without the ``1 / dp``. Either way the result does not depend on ``dp`` or ``m``: this is
    what makes a rescale change speed and never the maths (up to float reduction order).
    """
    if reduction not in ("mean", "sum"):
        raise SpecError(f"reduction={reduction!r}: say 'mean' (DDP/FSDP2 average over ranks) or 'sum'")
    # everything is checked here, before the first batch is asked for, so bad arguments fail at
    # the call and not somewhere inside the user's loop
    samples = step_samples(step, global_batch, len(corpus), seed)
    pieces = rank_micro_batches(samples, dp_rank, dp_size, micro_batch_size)
    # one rounding: (dp * |mb|) / G, not (dp / G) * |mb|
    factor = dp_size if reduction == "mean" else 1
    return (Batch(*corpus.samples(ids), tuple(ids), factor * len(ids) / global_batch) for ids in pieces)
