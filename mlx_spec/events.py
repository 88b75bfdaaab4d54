"""What a generation reports as it goes, and the record of all of it.

Engine.run yields, in order: `Prefilling` after each chunk of a long prompt but the last,
`Prefilled` once the prompt is in the cache; at each verification
step a `Step`, then a `Token` for each token it committed (with the text that token releases);
a `Text` for text the detokenizer releases only at the end; and `Done` with the complete
`Stats` (the same object `Prefilled` carried). A batch reports `Failed` for a generation that
failed and left. `Collector` gathers them: tokens, text, stats, the histogram of tokens
committed per step."""

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

# Every statistic of a generation, defined once: `generate --json` writes these keys in this
# order, the README's table lists them, the server's usage and bench read the same names.
STATISTICS = {
    "prompt_tokens": "tokens in the prompt",
    "prompt_cached": "prompt tokens whose K/V the cache already held (an earlier call or request)",
    "prompt_seconds": "seconds computing the other prompt tokens but the last (the first step feeds it)",
    "prompt_tokens_per_second": "those tokens per second; null where there were none (a one-token prompt, "
    "or a prompt the cache held but its last token)",
    "generated_tokens": "tokens of the reply (an end-of-text token that ends it is not one)",
    "generate_seconds": "seconds from the end of the prompt to the end of the reply",
    "tokens_per_second": "generated_tokens / generate_seconds",
    "steps": "verification steps: target passes over [last token + the drafts kept]",
    "plain_steps": "steps that verified no draft (the policy judged drafting not worth it, or nothing was drafted)",
    "committed_tokens": "tokens the steps committed: accepted drafts + one target token per step (an "
    "end-of-text token included)",
    "tokens_per_step": "committed_tokens / steps (tau; plain decoding: 1)",
    "drafted_tokens": "tokens the drafter proposed, verified or not (a tree's nodes; the policy verifies "
    "only those that pay)",
    "verified_drafts": "drafted tokens a step verified",
    "verified_drafts_per_step": "verified_drafts / steps",
    "accepted_drafts": "verified drafts the target accepted (each a token committed without a pass of its own)",
    "acceptance_rate": "accepted_drafts / verified_drafts",
    "seed": "the seed that repeats a sampled reply (with the same prompt and settings)",
    "finish_reason": "eos (end of text), stop (a stop string), length (max tokens) or interrupted",
    "stop_string": "the stop string that ended the reply (finish_reason stop), else empty",
}


@dataclass
class Stats:
    """A generation's record (STATISTICS defines each figure)."""

    prompt_tokens: int = 0
    prompt_cached: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    committed_tokens: int = 0
    steps: int = 0
    plain_steps: int = 0
    drafted_tokens: int = 0
    verified_drafts: int = 0
    accepted_drafts: int = 0
    generate_seconds: float = 0.0
    finish_reason: str = ""
    stop_string: str = ""
    seed: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.committed_tokens / self.steps if self.steps else 0.0

    @property
    def verified_drafts_per_step(self) -> float:
        return self.verified_drafts / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.verified_drafts if self.verified_drafts else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0

    @property
    def prompt_tokens_per_second(self) -> Optional[float]:
        computed = self.prompt_tokens - self.prompt_cached - 1
        return computed / self.prompt_seconds if computed > 0 and self.prompt_seconds else None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in STATISTICS}


@dataclass(frozen=True)
class Prefilling:
    """Part of a long prompt is in the cache (a chunk of PREFILL_CHUNK tokens at a time): `done`
    of the `total` tokens a prefill computes (those not already cached)."""

    done: int
    total: int


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the cache; `stats` is the generation's record, filled in as it goes."""

    stats: Stats


@dataclass(frozen=True)
class Step:
    """One verification step: how many drafts it verified, how many of them it accepted."""

    verified: int
    accepted: int

    @property
    def committed(self) -> int:
        """Tokens the step committed: its accepted drafts and the target's own token."""
        return self.accepted + 1


@dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probability of a committed token at its position (after the logits
    processors, before temperature, as mlx-lm reports it) and the most likely alternatives."""

    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()  # (token id, log-probability), most likely first
    distribution: Any = None  # mx.array [V]: every token's (mlx-lm's `logprobs`)


@dataclass(frozen=True)
class Token:
    """A committed token of the reply and the text it releases ("" while the detokenizer, or a
    possible stop string, holds text back)."""

    id: int
    text: str
    from_draft: bool = False  # an accepted draft, not the target's own token of its step
    logprobs: Optional[TokenLogprobs] = None  # where the generation asked for them


@dataclass(frozen=True)
class Text:
    """Text released without a token of its own (the detokenizer's rest, at the end)."""

    text: str


@dataclass(frozen=True)
class Done:
    """The generation ended; `stats` is complete."""

    stats: Stats


@dataclass(frozen=True)
class Failed:
    """A batched generation failed and left the batch (the others go on)."""

    error: Exception


Event = Union[Prefilling, Prefilled, Step, Token, Text, Done, Failed]


@dataclass
class Collector:
    """A generation's events gathered: the reply's tokens and text, its stats, and how many
    steps committed each number of tokens. add() returns the event, so that a loop can collect
    and act at once."""

    tokens: List[int] = field(default_factory=list)
    pieces: List[str] = field(default_factory=list)
    from_draft: List[bool] = field(default_factory=list)
    logprobs: List[Optional[TokenLogprobs]] = field(default_factory=list)
    histogram: Counter = field(default_factory=Counter)  # tokens committed per step -> steps
    stats: Optional[Stats] = None
    error: Optional[Exception] = None

    def add(self, event: Event) -> Event:
        if isinstance(event, Token):
            self.tokens.append(event.id)
            self.from_draft.append(event.from_draft)
            self.logprobs.append(event.logprobs)
            self.pieces.append(event.text)
        elif isinstance(event, Text):
            self.pieces.append(event.text)
        elif isinstance(event, Step):
            self.histogram[event.committed] += 1
        elif isinstance(event, (Prefilled, Done)):
            self.stats = event.stats
        elif isinstance(event, Failed):
            self.error = event.error
        return event

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def sorted_histogram(self) -> Dict[int, int]:
        return dict(sorted(self.histogram.items()))

    @classmethod
    def of(cls, events: Iterable[Event]) -> "Collector":
        """Every event of a generation, collected (a Failed one raises its error)."""
        collector = cls()
        for event in events:
            collector.add(event)
            if isinstance(event, Failed):
                raise event.error
        return collector
