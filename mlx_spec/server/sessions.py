"""The prompt cache across requests: the engine's current conversation plus an LRU of earlier
ones (engine.Session: the target's cache, its tokens, the drafter's features), bounded in count
and bytes as mlx_lm.server's `--prompt-cache-size` / `--prompt-cache-bytes` are.

Before each request the conversation that shares the longest prefix with its prompt becomes
the engine's; the one it replaces is kept. A conversation the prompt continues moves into the
engine; one the prompt branches off before its end (another question after the same system
prompt, a regenerated turn) is copied, so that it stays for the requests still to come: under
batching several rows at once start from one stored prefix, as mlx_lm.server's trie of caches
lets them. Rollback after speculation happens inside the engine, so a session holds exactly
the tokens it says it holds."""

from typing import List, Optional

from ..cache import common_prefix_length
from ..engine import Engine, Session


class SessionCache:
    def __init__(self, engine: Engine, max_sessions: int = 10, max_bytes: int = 1 << 30):
        self.engine, self.max_sessions, self.max_bytes = engine, max_sessions, max_bytes
        self.stored: List[Session] = []   # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stored)

    def prepare(self, prompt: List[int], engine: Optional[Engine] = None) -> None:
        """Make the engine's conversation (default: the first engine's; a batch has one engine
        per row, all sharing this store) the one that shares most with `prompt`."""
        if not self.max_sessions:   # no store: the engine's own conversation is the cache
            return
        engine = engine or self.engine
        live = common_prefix_length(engine.cached_tokens, prompt)
        shared = [common_prefix_length(s.tokens, prompt) for s in self.stored]
        best = max(range(len(shared)), key=shared.__getitem__, default=None)
        if best is None or shared[best] <= live:
            if live < len(engine.cached_tokens):   # the prompt branches off: keep the rest too
                self._store(engine.copy_session())
            return
        branches = shared[best] < len(self.stored[best].tokens)
        session = self.stored[best].copy() if branches else self.stored.pop(best)
        if branches:   # the copy is the most recently used now
            self.stored.append(self.stored.pop(best))
        self._store(engine.detach())
        engine.attach(session)

    def keep(self, session: Session) -> None:
        """Store a conversation (a batch row's, once its request is done): every conversation
        not being generated for is then bounded by the same count and bytes."""
        self._store(session)

    def _store(self, session: Session) -> None:
        if not session.tokens:
            return
        tokens = session.tokens
        # A session that another one extends is worth nothing more than it.
        if any(s.tokens[:len(tokens)] == tokens for s in self.stored):
            return
        self.stored = [s for s in self.stored if tokens[:len(s.tokens)] != s.tokens]
        self.stored.append(session)
        while self.stored and (len(self.stored) > self.max_sessions or self.nbytes > self.max_bytes):
            self.stored.pop(0)
