"""The prompt cache across requests: the engine's current conversation plus an LRU of earlier
ones (engine.Session: the target's cache, its tokens, the drafter's features), bounded in count
and bytes as mlx_lm.server's `--prompt-cache-size` / `--prompt-cache-bytes` are.

Before each request the conversation that shares the longest prefix with its prompt becomes
the engine's; the one it replaces is kept. A conversation the prompt continues moves into the
engine; one the prompt branches off before its end (another question after the same system
prompt, a regenerated turn) is copied, so that it stays for the requests still to come: under
batching several rows at once start from one stored prefix, as mlx_lm.server's trie of caches
lets them. Rollback after speculation happens inside the engine, so a session holds exactly
the tokens it says it holds.

With a DiskCache, what the memory evicts and what it holds at shutdown go to disk, and a
prompt that an entry on disk continues further than anything in memory (by DISK_MIN_TOKENS at
least: reading a file costs more than computing a few tokens) starts from that entry."""

from typing import List, Optional, Sequence

from ..cache import common_prefix_length
from ..engine import Engine, Session
from .disk_cache import DiskCache

DISK_MIN_TOKENS = 16


class SessionCache:
    def __init__(
        self,
        engine: Engine,
        max_sessions: int = 10,
        max_bytes: int = 1 << 30,
        disk: Optional[DiskCache] = None,
    ):
        self.engine, self.max_sessions, self.max_bytes, self.disk = engine, max_sessions, max_bytes, disk
        self.stored: List[Session] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stored)

    def prepare(self, prompt: List[int], engine: Optional[Engine] = None) -> None:
        """Make the engine's conversation (default: the first engine's; a batch has one engine
        per row, all sharing this store) the one that shares most with `prompt`."""
        if (
            not self.max_sessions and self.disk is None
        ):  # no store: the engine's own conversation is the cache
            return
        engine = engine or self.engine
        live = common_prefix_length(engine.cached_tokens, prompt)
        shared = [common_prefix_length(s.tokens, prompt) for s in self.stored]
        best = max(range(len(shared)), key=shared.__getitem__, default=None)
        if self.disk is not None and self._from_disk(prompt, engine, max([live] + shared)):
            return
        if best is None or shared[best] <= live:
            if live < len(engine.cached_tokens):  # the prompt branches off: keep the rest too
                self._store(engine.copy_session())
            return
        branches = shared[best] < len(self.stored[best].tokens)
        session = self.stored[best].copy() if branches else self.stored.pop(best)
        if branches:  # the copy is the most recently used now
            self.stored.append(self.stored.pop(best))
        self._store(engine.detach())
        engine.attach(session)

    def _from_disk(self, prompt: List[int], engine: Engine, in_memory: int) -> bool:
        """Attach the entry on disk that continues the prompt furthest, where it beats memory."""
        on_disk, record = self.disk.longest(prompt, engine.drafter.taps)
        if on_disk < in_memory + DISK_MIN_TOKENS:
            return False
        session = self.disk.load(record)
        if session is None:
            return False
        self._store(engine.detach())
        engine.attach(session)
        return True

    def flush(self, engines: Sequence[Engine]) -> None:
        """At shutdown: every conversation to disk (the stored ones and the engines' own)."""
        if self.disk is not None:
            for session in self.stored + [engine.session for engine in engines]:
                self.disk.save(session)

    def keep(self, session: Session) -> None:
        """Store a conversation (a batch row's, once its request is done): every conversation
        not being generated for is then bounded by the same count and bytes."""
        self._store(session)

    def _store(self, session: Session) -> None:
        if not session.tokens:
            return
        tokens = session.tokens
        # A session that another one extends is worth nothing more than it.
        if any(s.tokens[: len(tokens)] == tokens for s in self.stored):
            return
        self.stored = [s for s in self.stored if tokens[: len(s.tokens)] != s.tokens]
        self.stored.append(session)
        while self.stored and (len(self.stored) > self.max_sessions or self.nbytes > self.max_bytes):
            evicted = self.stored.pop(0)
            if self.disk is not None:
                self.disk.save(evicted)
