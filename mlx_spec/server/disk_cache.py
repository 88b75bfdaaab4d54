"""Conversations on disk (serve --prompt-cache-dir): what the memory's prompt cache evicts, and
what it holds at shutdown, written so that a restarted server, or a second one on the same
directory, continues a conversation without computing its prompt again.

One entry per conversation, named by a hash of the model's identity and its tokens:
<id>.safetensors, the target's cache in mlx-lm's prompt cache format (save_prompt_cache);
<id>.taps.safetensors, the target's features the drafter reads (where it reads any); <id>.json,
written last, the entry's record (format, model identity, tokens, tap layers, bytes): a
directory listing of records is the index, and an entry without one does not exist. Files are
written under temporary names and renamed, under a lock on the directory (two servers may
share it); past the byte bound the least recently used entries go. A record of another format
or model (a directory per model makes those rare), one that cannot be read, or whose cache
another model made: one warning line, and the entry is not used (never a crash,
never a wrong answer: the cache is checked against the model as mlx_lm.cache_prompt files
are)."""

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import save_prompt_cache

from ..cache import PROMPT_CACHE_LAYERS, common_prefix_length, read_prompt_cache
from ..engine import Session
from ..errors import MlxSpecError
from ..models.checkpoint import one_line

FORMAT = 1
DEFAULT_MAX_BYTES = 8 << 30


def model_identity(target) -> Optional[str]:
    """What a cache's numbers depend on: the configuration, the weights files (name, size,
    modification time; in the hub cache the blob's content hash) and the dtype they run in.
    None: a model with no directory (built in memory), whose caches are not written."""
    if not target.path or not Path(target.path, "config.json").is_file():
        return None
    path = Path(target.path)
    weights = []
    for file in sorted(path.glob("*.safetensors")):
        real = file.resolve()
        stat = real.stat()
        weights.append([file.name, real.name, stat.st_size, stat.st_mtime_ns])
    parameters = tree_flatten(target.model.parameters())
    record = {
        "config": (path / "config.json").read_text(),
        "weights": weights,
        "dtype": str(target.dtype),
        "parameter_dtype": str(parameters[0][1].dtype) if parameters else "",
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def default_directory(target, identity: str) -> Path:
    from ..models.default import cache_dir

    name = Path(str(target.path)).name if target.path else "model"
    return cache_dir() / "prompt-cache" / f"{name}-{identity}"


class DiskCache:
    def __init__(
        self,
        directory: Path,
        target,
        identity: str,
        max_bytes: int = DEFAULT_MAX_BYTES,
        log: Callable[[str], None] = print,
    ):
        self.directory, self.target, self.identity = Path(directory), target, identity
        self.max_bytes, self.log = max_bytes, log
        self.directory.mkdir(parents=True, exist_ok=True)
        self.warned = set()  # entries already warned about

    # --- what is there ----------------------------------------------------------------------

    def records(self) -> List[dict]:
        """Every readable record of this model's entries."""
        out = []
        for path in self.directory.glob("*.json"):
            try:
                record = json.loads(path.read_text())
                if record.get("format") != FORMAT or record.get("model") != self.identity:
                    self._warn(
                        path.stem,
                        f"prompt cache entry {path} not used: written by another "
                        f"{'model' if record.get('format') == FORMAT else 'version of mlx-spec'}",
                    )
                    continue
                record["id"] = path.stem
                out.append(record)
            except (OSError, ValueError, AttributeError) as e:
                self._warn(path.stem, f"cannot read {path}: {e}")
        return out

    def longest(self, prompt: List[int], layers) -> Tuple[int, Optional[dict]]:
        """(tokens shared, the record) of the entry sharing the longest prefix with the prompt
        that holds the features of these tap layers; (0, None) when none shares any."""
        best, found = 0, None
        for record in self.records():
            if not set(layers) <= set(record.get("taps", [])) or record["id"] in self.warned:
                continue
            shared = common_prefix_length(record["tokens"], prompt)
            if shared > best:
                best, found = shared, record
        return best, found

    def load(self, record: dict) -> Optional[Session]:
        """The entry as a session; None (and one warning line) where it cannot be used."""
        entry = record["id"]
        try:
            cache = read_prompt_cache(
                self.directory / f"{entry}.safetensors", self.target.model, self.target.model_type
            )
            tokens = [int(t) for t in record["tokens"]]
            held = [c.offset for c in cache if hasattr(c, "offset")]
            if any(n != len(tokens) for n in held):
                raise MlxSpecError(f"its cache holds {held[0]} positions for {len(tokens)} tokens")
            taps = {}
            if record.get("taps"):
                stored = mx.load(str(self.directory / f"{entry}.taps.safetensors"))
                taps = {int(layer): [stored[str(layer)]] for layer in record["taps"]}
                if any(pieces[0].shape[1] != len(tokens) for pieces in taps.values()):
                    raise MlxSpecError("its features do not cover its tokens")
        except (MlxSpecError, OSError, ValueError, KeyError, RuntimeError) as e:
            self._warn(entry, f"prompt cache entry {entry} not used: {one_line(e)}")
            return None
        os.utime(self.directory / f"{entry}.json")  # recently used
        return Session(tokens, cache, taps)

    # --- writing ----------------------------------------------------------------------------

    @staticmethod
    def writable(session: Session) -> bool:
        """mlx-lm's format holds plain caches (not a window, a quantized or a ragged one)."""
        return bool(session.tokens) and all(
            type(c).__name__ in PROMPT_CACHE_LAYERS and type(c).__name__ != "QuantizedKVCache"
            for c in session.cache
        )

    def save(self, session: Session) -> None:
        """Write a conversation (and drop the entries it continues), then keep the directory in
        its bound. A failure to write is one warning line: the server serves on."""
        if not self.writable(session):
            return
        tokens = list(session.tokens)
        entry = hashlib.sha256(json.dumps([self.identity, tokens]).encode()).hexdigest()[:32]
        if (self.directory / f"{entry}.json").exists():  # already there
            os.utime(self.directory / f"{entry}.json")
            return
        try:
            self._write(entry, session, tokens)
        except (OSError, RuntimeError, ValueError) as e:
            self.log(f"warning: cannot write to the prompt cache directory {self.directory}: {one_line(e)}")

    def _write(self, entry: str, session: Session, tokens: List[int]) -> None:
        taps = {
            str(layer): mx.concatenate(pieces, axis=1) for layer, pieces in session.taps.items() if pieces
        }
        with self._locked():
            cache_file = self.directory / f"{entry}.safetensors"
            self._replace(
                cache_file,
                lambda path: save_prompt_cache(str(path), session.cache, {"mlx_spec_format": str(FORMAT)}),
            )
            if taps:
                self._replace(
                    self.directory / f"{entry}.taps.safetensors",
                    lambda path: mx.save_safetensors(str(path), taps),
                )
            files = [cache_file] + ([self.directory / f"{entry}.taps.safetensors"] if taps else [])
            record = {
                "format": FORMAT,
                "model": self.identity,
                "tokens": tokens,
                "taps": sorted(int(layer) for layer in taps),
                "bytes": sum(f.stat().st_size for f in files),
            }
            self._replace(self.directory / f"{entry}.json", lambda path: path.write_text(json.dumps(record)))
            for other in self.records():  # what this one continues is worth nothing more
                if other["id"] != entry and tokens[: len(other["tokens"])] == other["tokens"]:
                    self.remove(other["id"])
            self._evict()

    def _replace(self, path: Path, write) -> None:
        # mlx-lm and MLX add .safetensors to a name without it: the temporary name keeps it
        temporary = path.with_name(f".{os.getpid()}.{path.name}")
        try:
            write(temporary)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)

    def _evict(self) -> None:
        """Least recently used entries out until the directory's entries fit max_bytes."""
        entries = []
        for path in self.directory.glob("*.json"):
            try:
                entries.append(
                    (path.stat().st_mtime_ns, path.stem, json.loads(path.read_text()).get("bytes", 0))
                )
            except (OSError, ValueError, AttributeError):
                continue
        total = sum(size for _, _, size in entries)
        for _, entry, size in sorted(entries):
            if total <= self.max_bytes:
                break
            self.remove(entry)
            total -= size

    def remove(self, entry: str) -> None:
        (self.directory / f"{entry}.json").unlink(missing_ok=True)  # first: the entry is gone
        for suffix in (".safetensors", ".taps.safetensors"):
            (self.directory / f"{entry}{suffix}").unlink(missing_ok=True)

    @contextmanager
    def _locked(self):
        with open(self.directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _warn(self, entry: str, message: str) -> None:
        if entry not in self.warned:
            self.warned.add(entry)
            self.log(f"warning: {message}")

    @property
    def stats(self) -> Dict[str, int]:
        records = self.records()
        return {
            "entries": len(records),
            "bytes": sum(r.get("bytes", 0) for r in records),
            "max_bytes": self.max_bytes,
        }
