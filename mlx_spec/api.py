"""mlx-spec from Python, in mlx-lm's shape:

    from mlx_spec import load, generate, stream_generate

    model, tokenizer = load("mlx-community/Qwen3-4B-4bit", draft="lookup")
    text = generate(model, tokenizer, prompt, max_tokens=256, verbose=True)

`model` is an `Engine`: the target with its drafter and cache, kept across calls (a chat's next
turn computes only its new tokens). Model names, directories or Hugging Face repo ids, are
resolved here, once, for the CLI too."""

import secrets
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

from .engine import Engine, GenerationOptions
from .errors import MlxSpecError
from .events import Collector, Event, Failed, Prefilled, Stats, Text, Token
from .hub import resolve

# The finish reasons mlx-lm and the OpenAI API use, for the engine's.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def model_path(path_or_hf_repo: Optional[str] = None, revision: Optional[str] = None) -> Path:
    """The local directory of a model: the embedded default model when None, a directory, or a
    Hugging Face repo id (downloaded once into the hub cache)."""
    if path_or_hf_repo is None:
        from .convert.default import default_model_path

        return default_model_path()
    return resolve(path_or_hf_repo, revision, "model")


def draft_model_path(method: str, draft_model: Optional[str]) -> Optional[str]:
    """The local directory of `draft_model` for --draft `method` (as given where the source
    takes none: the registry then says so)."""
    from .drafters import DRAFTERS, check_method

    if method == "auto":  # it takes none: auto.choose says so
        return draft_model
    if draft_model and "draft_model" in DRAFTERS[check_method(method)].options.names():
        return str(resolve(draft_model, None, "draft model"))
    return draft_model


@dataclass(frozen=True)
class Loaded:
    engine: Engine
    tokenizer: Any
    draft: str  # the source it runs (what --draft auto chose)
    why: Optional[str] = None  # why --draft auto chose it


def load(path_or_hf_repo: Optional[str] = None, **settings):
    """(model, tokenizer) of load_model: mlx-lm's shape."""
    loaded = load_model(path_or_hf_repo, **settings)
    return loaded.engine, loaded.tokenizer


def load_model(path_or_hf_repo: Optional[str] = None, confirm=None, **settings) -> Loaded:
    """The target (default: the embedded SmolLM2-135M-Instruct) with the
    draft source `draft` (default "lookup"; see mlx_spec.drafters.DRAFTERS), adaptive by
    default. Every setting is an EngineConfig field, named as the CLI's options (config.py:
    draft, draft_model, num_draft_tokens, adaptive, stop_early, the source's own ngram_*,
    tree_*, suffix_memory, exit_layer; dtype, revision; temp, top_p, top_k, min_p, seed,
    residual_sampling; mlx-lm's max_kv_size, kv_bits, kv_group_size, quantized_kv_start;
    sharding, rank_timeout; sessions). `draft_model`: a directory or a repo id. An option the
    source does not read is refused. kv_bits: mlx-lm's quantized KV cache (with draft="none"
    only: see cache.KVQuantization). sharding ("tensor" or "pipeline"): the target split over
    the processes mlx.launch started (distributed.py): rank 0 gets the engine; on the other
    ranks load serves rank 0's passes and ends the process when rank 0 is done (or gone).
    The sampling settings are the engine's defaults, which each generate call may override.
    draft="auto" (auto.py): the model's MTP module, else a drafter published for it, else
    suffix; confirm(question) -> bool may allow a drafter's download (download_drafter=True
    allows it without asking)."""
    from .auto import SPLIT_REFUSED, auto_engine
    from .cache import is_bounded
    from .config import EngineConfig, build_engine
    from .models.target import load_target

    _refuse_sampler(settings)
    config = EngineConfig.of(path_or_hf_repo=path_or_hf_repo, **settings)
    draft = config.draft
    config = replace(
        config, draft=replace(draft, draft_model=draft_model_path(draft.draft, draft.draft_model))
    )
    path = model_path(config.model.path_or_hf_repo, config.model.revision)
    if config.split.sharding:
        if config.draft.draft == "auto":
            raise MlxSpecError(SPLIT_REFUSED)
        return Loaded(*_load_split(path, config), config.draft.draft)
    target = load_target(path, config.model.dtype)
    if config.draft.draft == "auto":
        engine, choice = auto_engine(target, config, confirm)
        loaded = Loaded(engine, target.tokenizer, choice.draft, choice.why)
    else:
        loaded = Loaded(build_engine(target, config), target.tokenizer, config.draft.draft)
    if config.cache.max_kv_size and not is_bounded(loaded.engine.cache):
        print(
            f"mlx-spec: --max-kv-size: this {target.model_type} model builds its own cache, which mlx-lm "
            "does not bound either",
            file=sys.stderr,
        )
    return loaded


def _load_split(path, config):
    """load's (engine, tokenizer) on rank 0 of a split target; the other ranks follow it, then exit."""
    import atexit

    from .config import build_engine, engine_settings
    from .distributed import SplitTarget

    split = SplitTarget(path, config.model.dtype, config.split.sharding, config.split.rank_timeout)
    if not split.leader:
        split.follow(**engine_settings(config))
        sys.exit(0)
    engine = build_engine(split.target, config, split)
    atexit.register(engine.close)  # for a caller that never closes it
    return engine, split.target.tokenizer


def _refuse_sampler(settings: dict) -> None:
    if "sampler" in settings:
        raise MlxSpecError(
            "mlx-spec samples from the target's distribution itself (exactly, whatever "
            "the drafts): pass temp, top_p, top_k, min_p instead of a sampler"
        )


def sampling_params(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, **unknown):
    from .sampling import SamplingParams

    _refuse_sampler(unknown)
    if unknown:
        raise MlxSpecError(
            f"unknown argument {sorted(unknown)[0]!r}: mlx-spec takes temp, top_p, top_k, "
            "min_p, seed, max_tokens, stop"
        )
    return SamplingParams(temp=float(temp), top_p=float(top_p), top_k=int(top_k), min_p=float(min_p))


@dataclass
class GenerationResponse:
    """One piece of `stream_generate`'s output: mlx-lm's fields (but logprobs) and the
    speculative statistics so far. The last response has finish_reason ("stop": end of text or
    a stop string; "length": max_tokens) and `stats`, the whole record of the generation."""

    text: str
    token: Optional[int]  # None only where the reply ended before its first token
    from_draft: bool  # an accepted draft, not the target's own token
    prompt_tokens: int
    prompt_tps: Optional[float]  # None: no prompt token computed apart from the first step's
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    steps: int  # verification steps so far
    tokens_per_step: float
    acceptance_rate: float
    plain_steps: int  # steps so far that verified no draft
    finish_reason: Optional[str] = None
    stats: Optional[Stats] = None
    # Where the call asked for them (logprobs=True or top_logprobs=k): mlx-lm's `logprobs`, the
    # target's log-probabilities [V] at this token's position (after the logits processors),
    # this token's, and the top_logprobs most likely tokens (id, log-probability).
    logprobs: Any = None
    logprob: Optional[float] = None
    top_logprobs: Tuple[Tuple[int, float], ...] = ()


def is_conversation(prompt) -> bool:
    """A chat's messages ([{"role": ..., "content": ...}, ...]) rather than text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _encode(tokenizer, prompt, tools=None, chat_template_kwargs=None) -> List[int]:
    """Token ids of a prompt: text encoded as it is (as mlx-lm does: no chat template), token
    ids as they are, a list of messages through the chat template (with `tools` and the
    template's own arguments, e.g. {"enable_thinking": False})."""
    if is_conversation(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise MlxSpecError("this model has no chat template: give the prompt as text or token ids")
        if tools and not getattr(tokenizer, "has_tool_calling", False):
            raise MlxSpecError("this model's chat template has no tool calling: drop tools")
        return list(
            tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tools=tools or None, **(chat_template_kwargs or {})
            )
        )
    if isinstance(prompt, str):
        # As mlx-lm: a prompt that already starts with the BOS token gets no second one.
        bos = getattr(tokenizer, "bos_token", None)
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    return [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]


class Responses:
    """Engine events -> GenerationResponses. Each response is held until the next event, so
    that the last one (from `last`) carries the finish reason and the stats."""

    def __init__(self):
        self.stats, self.pending = None, None
        self.start = time.perf_counter()

    def _response(self, token: Optional[Token]) -> GenerationResponse:
        import mlx.core as mx

        stats = self.stats
        elapsed = time.perf_counter() - self.start - stats.prompt_seconds
        logprobs = token.logprobs if token is not None else None
        return GenerationResponse(
            text=token.text if token else "",
            token=token.id if token else None,
            from_draft=bool(token and token.from_draft),
            prompt_tokens=stats.prompt_tokens,
            prompt_tps=stats.prompt_tokens_per_second,
            generation_tokens=stats.generated_tokens,
            generation_tps=stats.generated_tokens / elapsed if elapsed > 0 else 0.0,
            peak_memory=mx.get_peak_memory() / 1e9,
            steps=stats.steps,
            tokens_per_step=stats.tokens_per_step,
            acceptance_rate=stats.acceptance_rate,
            plain_steps=stats.plain_steps,
            **(
                dict(logprobs=logprobs.distribution, logprob=logprobs.logprob, top_logprobs=logprobs.top)
                if logprobs is not None
                else {}
            ),
        )

    def add(self, event: Event) -> Iterator[GenerationResponse]:
        if isinstance(event, Prefilled):
            self.stats = event.stats
        elif isinstance(event, Token):
            if self.pending is not None:
                yield self.pending
            self.pending = self._response(event)
        elif isinstance(event, Text):
            self.pending.text += event.text

    def last(self) -> GenerationResponse:
        """The last response, once the generation is done."""
        last = self.pending if self.pending is not None else self._response(None)
        last.finish_reason = FINISH_REASONS.get(self.stats.finish_reason)
        last.stats = self.stats
        return last


def sampling_and_seed(model: Engine, seed: Optional[int], sampling: dict):
    """A call's SamplingParams (None: the engine's) and seed (a fresh one where neither the
    call nor the engine gives one, so that the stats report it)."""
    params = sampling_params(**sampling) if sampling else None
    return params, (secrets.randbits(32) if seed is None and model.seed is None else seed)


Prompt = Union[str, Sequence[int], Sequence[dict]]


def generation_options(
    tokenizer, logits_processors=None, logprobs: bool = False, top_logprobs: int = 0, prediction=None
) -> GenerationOptions:
    """A call's GenerationOptions: mlx-lm's logits processors (make_logits_processors: pure
    functions of the tokens before a position and its logits), logprobs (and the top_logprobs
    most likely alternatives), a prediction of the reply (text or token ids) that drafts too."""
    if isinstance(prediction, str):
        prediction = tokenizer.encode(prediction, add_special_tokens=False)
    asked = bool(logprobs or top_logprobs)
    return GenerationOptions(
        logits_processors=tuple(logits_processors or ()),
        logprobs=top_logprobs if asked else None,
        distribution=asked,
        prediction=tuple(int(t) for t in prediction or ()),
    )


def stream_generate(
    model: Engine,
    tokenizer,
    prompt: Prompt,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    seed: Optional[int] = None,
    logits_processors=None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prediction=None,
    tools=None,
    chat_template_kwargs=None,
    **sampling,
) -> Iterator[GenerationResponse]:
    """Yield a GenerationResponse per generated token (text segments as they are committed).
    prompt: a list of messages (the chat template applied, with `tools` and
    `chat_template_kwargs`), text (encoded as is, as mlx-lm does: no chat template) or token ids.
    seed: the same seed gives the same sampled text whatever the draft source (default: a
    fresh one per call, in the last response's stats). logits_processors, logprobs,
    top_logprobs, prediction: see generation_options."""
    params, seed = sampling_and_seed(model, seed, sampling)
    options = generation_options(tokenizer, logits_processors, logprobs, top_logprobs, prediction)
    responses = Responses()
    for event in model.generate(
        _encode(tokenizer, prompt, tools, chat_template_kwargs),
        max_tokens=max_tokens,
        stop_strings=list(stop),
        sampling=params,
        seed=seed,
        options=options,
    ):
        yield from responses.add(event)
    yield responses.last()


@dataclass
class BatchResponse:
    texts: List[str]  # in the order of the prompts
    stats: List[Stats]  # each generation's, in the same order


def batch_generate(
    model: Engine,
    tokenizer,
    prompts: Sequence[Prompt],
    max_tokens: int = 256,
    max_batch: int = 8,
    stop: Sequence[str] = (),
    seed: Optional[int] = None,
    logits_processors=None,
    tools=None,
    chat_template_kwargs=None,
    **sampling,
) -> BatchResponse:
    """Generate for several prompts at once, as mlx-lm's batch_generate: up to max_batch share
    each target pass (continuous batching: a prompt starts as another finishes), each with the
    engine's draft source, each what `generate` alone would write (prompt i samples with seed
    + i); each prompt as `generate` takes it (messages, text or token ids). The engine and
    max_batch - 1 copies of it (the same weights) serve the rows."""
    from .batch import BatchEngine

    params, seed = sampling_and_seed(model, seed, sampling)
    batch = BatchEngine.spawned(model, min(max_batch, max(1, len(prompts))))
    options = generation_options(tokenizer, logits_processors)
    requests = [
        dict(
            prompt=_encode(tokenizer, prompt, tools, chat_template_kwargs),
            max_tokens=max_tokens,
            stop_strings=list(stop),
            sampling=params,
            seed=None if seed is None else seed + i,
            options=options,
        )
        for i, prompt in enumerate(prompts)
    ]
    collected = [Collector() for _ in prompts]
    for i, event in batch.generate_all(requests):
        if isinstance(collected[i].add(event), Failed):
            raise event.error
    return BatchResponse([c.text for c in collected], [c.stats for c in collected])


def generate(model: Engine, tokenizer, prompt: Prompt, verbose: bool = False, **kwargs) -> str:
    """The whole reply as text (kwargs as stream_generate's). verbose: print it as it comes,
    then the statistics, as mlx_lm.generate does."""
    text = []
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        text.append(response.text)
        if verbose:
            print(response.text, end="", flush=True)
    if verbose:
        print()
        print("=" * 10)
        print(stats_line(response.stats, model.speculative, not model.sampler.greedy))
    return "".join(text)


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


ENDINGS = {
    "eos": "ended by end of text",
    "length": "cut at --max-tokens",
    "stop": "ended by a stop string",
    "interrupted": "interrupted",
}


def stats_line(stats, speculative: bool = True, sampled: bool = False) -> str:
    """One line, each figure named by what it counts: the prompt tokens the cache already held
    are not in the prompt rate; a step commits its accepted drafts and the target's own token,
    the end-of-text token included (it ends the reply but is not printed); the seed repeats a
    sampled reply."""
    cached = f" ({stats.prompt_cached} cached)" if stats.prompt_cached else ""
    rate = stats.prompt_tokens_per_second
    parts = [
        f"prompt: {count(stats.prompt_tokens, 'token')}{cached}" + (f", {rate:.1f} tok/s" if rate else "")
    ]
    ending = ENDINGS.get(stats.finish_reason)
    parts.append(
        f"reply: {count(stats.generated_tokens, 'token')}, {stats.tokens_per_second:.1f} tok/s"
        + (f", {ending}" if ending else "")
    )
    if not speculative:
        parts.append(f"{count(stats.steps, 'step')} (no drafting)")
    else:
        committed = ""
        if stats.committed_tokens != stats.generated_tokens:
            eos = ", end of text included" if stats.finish_reason == "eos" else ""
            committed = f" ({stats.committed_tokens} committed{eos})"
        parts.append(f"{count(stats.steps, 'step')}, {stats.tokens_per_step:.2f} tokens/step{committed}")
        parts.append(
            f"drafts: {stats.verified_drafts} verified, {stats.accepted_drafts} accepted "
            f"({stats.acceptance_rate:.0%}); {count(stats.plain_steps, 'plain step')} (no draft verified)"
            if stats.verified_drafts
            else "drafts: none verified"
        )
    if sampled:
        parts.append(f"seed {stats.seed}")
    return " | ".join(parts)
