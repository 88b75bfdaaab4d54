"""The memory of suffix decoding: token ids of earlier outputs of one target model, kept on
disk across runs, searched for what followed the context's recent tokens.

The file (<cache>/suffix-memory/<model>-<vocabulary hash>.npz, or --suffix-memory PATH) holds
the outputs' token ids and lengths, oldest first, a format version, the hash of the
tokenizer's vocabulary they were written with, and a serial that each write increments. It is
read lazily (at the first search), written atomically (a temporary file renamed over it) under
a lock that lets two processes add to it at once (each write merges what the other wrote), and
bounded: past max_tokens the oldest outputs go. A file that cannot be read, or that another
tokenizer wrote, is set aside with a one-line warning and rebuilt from nothing.

The index: for each match length n, the hash of every n-gram of the memory that has a token
after it, sorted (with its end position), so that the occurrences of the context's last n
tokens are a binary search away; outputs added by this process are merged into it in
O(memory) array copies, without a rebuild."""

import fcntl
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np

FORMAT = 1
MATCH_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # suffix lengths matched, longest first when searching
MAX_OCCURRENCES = 64  # most recent occurrences whose continuations count
DEFAULT_MAX_TOKENS = 1 << 18  # 256Ki tokens: 1 MiB on disk, ~25 MB of index
_BASE = np.uint64(1_000_003)


def vocabulary_hash(tokenizer) -> str:
    """What the memory's token ids mean: a hash of the tokenizer's vocabulary."""
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def default_path(target) -> Path:
    from .models.default import cache_dir

    name = Path(str(target.path)).name if target.path else "model"
    return cache_dir() / "suffix-memory" / f"{name}-{vocabulary_hash(target.tokenizer)}.npz"


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len(tokens) - n + 1] the hash of each n-gram, by its last position (uint64 arithmetic wraps)."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    for j in range(n):
        h = h * _BASE + t[j : len(tokens) - n + 1 + j]
    return h


def _hash(tokens: Sequence[int]) -> np.uint64:
    return _hashes(np.asarray(tokens, dtype=np.int64), len(tokens))[0]


class SuffixMemory:
    def __init__(self, path, vocabulary: str, max_tokens: int = DEFAULT_MAX_TOKENS, learn_now: bool = True):
        """learn_now False: outputs added go to the file only, searched from the next run on
        (a benchmark's repeats then all see the memory as it was before the run)."""
        self.path, self.vocabulary, self.max_tokens = Path(path), vocabulary, max_tokens
        self.learn_now = learn_now
        self.outputs: Optional[List[np.ndarray]] = None  # None: not read yet
        self.serial = 0  # of the file version this process holds
        self.unsaved: List[np.ndarray] = []
        self.index = None  # n -> (sorted hashes, their end positions); None: to build
        self.tokens = np.zeros(0, dtype=np.int32)  # the outputs, each followed by -1

    # -- the file --------------------------------------------------------------------------

    def _read(self) -> Tuple[List[np.ndarray], int]:
        """(outputs, serial) of the file; nothing where there is none or it cannot be trusted."""
        if not self.path.exists():
            return [], 0
        try:
            with np.load(self.path, allow_pickle=False) as f:
                version, vocabulary = int(f["format"]), str(f["vocabulary"])
                tokens, lengths, serial = f["tokens"], f["lengths"], int(f["serial"])
            if version != FORMAT or vocabulary != self.vocabulary:
                why = "another tokenizer's" if version == FORMAT else f"format {version}"
                print(f"mlx-spec: suffix memory {self.path} is {why}: starting a new one", file=sys.stderr)
                return [], 0
            if lengths.sum() != len(tokens) or (lengths < 0).any():
                raise ValueError("lengths do not add up")
            return list(np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1])) if len(
                lengths
            ) else [], serial
        except Exception as e:  # a truncated or foreign file: never trusted, rebuilt
            print(
                f"mlx-spec: suffix memory {self.path} is unreadable ({type(e).__name__}): starting a new one",
                file=sys.stderr,
            )
            return [], 0

    def _load(self) -> None:
        if self.outputs is None:
            self.outputs, self.serial = self._read()
            self._bound()
            self.index = None

    def _bound(self) -> bool:
        """Drop the oldest outputs past max_tokens (down to 3/4 of it, so that a rebuild of the
        index is rare). True if any went."""
        total = sum(len(o) for o in self.outputs)
        if total <= self.max_tokens:
            return False
        while self.outputs and total > self.max_tokens * 3 // 4:
            total -= len(self.outputs.pop(0))
        return True

    def save(self) -> None:
        """Write the outputs added since the last save, merged with what other processes wrote."""
        if not self.unsaved:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.path) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            outputs, serial = self._read()
            if serial != self.serial or not self.learn_now:  # adopt what another process wrote
                self.outputs, self.index = outputs + self.unsaved, None
            if self._bound():
                self.index = None
            tokens = np.concatenate(self.outputs) if self.outputs else np.zeros(0, dtype=np.int32)
            self.serial = serial + 1
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    np.savez(
                        f,
                        format=np.int64(FORMAT),
                        vocabulary=np.array(self.vocabulary),
                        tokens=tokens.astype(np.int32),
                        serial=np.int64(self.serial),
                        lengths=np.array([len(o) for o in self.outputs], dtype=np.int64),
                    )
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
            self.unsaved = []

    # -- adding and searching --------------------------------------------------------------

    def add(self, output: Sequence[int]) -> None:
        """Remember an output (kept in the index at once; on disk at the next save)."""
        if len(output) < 2:
            return
        self._load()
        output = np.asarray(output, dtype=np.int32)
        self.unsaved.append(output)
        if not self.learn_now:
            return
        self.outputs.append(output)
        if self._bound():
            self.index = None
        elif self.index is not None:
            start = len(self.tokens)
            self.tokens = np.concatenate([self.tokens, output, [-1]]).astype(np.int32)
            for n, (hashes, ends) in self.index.items():
                new_hashes, new_ends = self._ngrams(output, n, start)
                at = np.searchsorted(hashes, new_hashes, side="right")  # after equal (older) ones
                self.index[n] = (np.insert(hashes, at, new_hashes), np.insert(ends, at, new_ends))

    @staticmethod
    def _ngrams(output: np.ndarray, n: int, start: int):
        """The sorted hashes of output's n-grams that have a token after them, and their end
        positions (output sits at `start` in the memory)."""
        if len(output) <= n:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        hashes = _hashes(output[:-1], n)
        ends = np.arange(n - 1, len(output) - 1, dtype=np.int64) + start
        order = np.argsort(hashes, kind="stable")
        return hashes[order], ends[order]

    def _build(self) -> None:
        self._load()
        pieces = [np.concatenate([o, [-1]]) for o in self.outputs]
        self.tokens = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
        self.index = {}
        starts = np.cumsum([0] + [len(p) for p in pieces])
        for n in MATCH_LENGTHS:
            parts = [self._ngrams(o, n, s) for o, s in zip(self.outputs, starts)]
            hashes = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint64)
            ends = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
            order = np.lexsort((ends, hashes))  # by hash, then oldest first
            self.index[n] = (hashes[order], ends[order])

    def continuations(self, context: Sequence[int], depth: int) -> Tuple[int, List[List[int]]]:
        """(n, what followed the most recent occurrences of the context's last n tokens, up to
        `depth` tokens each) for the longest n of MATCH_LENGTHS that occurs; (0, []) if none."""
        if self.index is None:
            self._build()
        if not len(self.tokens):
            return 0, []
        for n in reversed(MATCH_LENGTHS):
            if n > len(context):
                continue
            query = list(context[-n:])
            hashes, ends = self.index[n]
            lo, hi = (
                np.searchsorted(hashes, _hash(query), "left"),
                np.searchsorted(hashes, _hash(query), "right"),
            )
            found = []
            for end in ends[lo:hi][::-1]:  # most recent first
                if self.tokens[end - n + 1 : end + 1].tolist() == query:  # not a hash collision
                    found.append(self._continuation(int(end) + 1, depth))
                    if len(found) == MAX_OCCURRENCES:
                        break
            if found:
                return n, found
        return 0, []

    def _continuation(self, start: int, depth: int) -> List[int]:
        piece = self.tokens[start : start + depth].tolist()
        return piece[: piece.index(-1)] if -1 in piece else piece

    def __len__(self) -> int:
        self._load()
        return sum(len(o) for o in self.outputs)


def open_memory(target, spec) -> Optional[SuffixMemory]:
    """--suffix-memory: None, the target's default file; "off", no memory; a file; or a
    SuffixMemory already open (shared by several drafters)."""
    if spec == "off":
        return None
    if isinstance(spec, SuffixMemory):
        return spec
    path = default_path(target) if spec is None else Path(spec).expanduser()
    if path.is_dir():
        from .errors import MlxSpecError

        raise MlxSpecError(f"--suffix-memory {spec}: a directory; give a file (or off)")
    return SuffixMemory(path, vocabulary_hash(target.tokenizer))
