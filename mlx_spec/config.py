"""One configuration of an engine, declared once: the model, the draft source and its options,
sampling, mlx-lm's KV-cache flags and the split over ranks. Each field carries its help text and
its heading; the CLI's options are generated from these fields (cli/common.py), `api.load`'s
keywords are their names, and `build_engine` makes the engine of a configuration for the API,
the CLI, bench, the server and batch_generate alike."""

from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Optional

from .drafters import (
    DRAFTERS,
    SourceOptions,
    draft_tokens,
    make_drafter,
    option_names,
    source_options,
    sources_reading,
)
from .errors import MlxSpecError

# The engine, the cache and sampling (mlx-lm, ~2 s to import) are imported where an engine is
# built: the CLI reads these fields to parse its options and print --help without them.


def setting(default, help: str, *, flag: Optional[str] = None, type: tuple = (), show_default: bool = True):
    """A configuration field with what the CLI says of it: its help, its flag (default
    --field-name; "--a/--b" for a switch), its click type as (name, *arguments), e.g.
    ("IntRange", 1) for click.IntRange(1)."""
    return field(default=default, metadata=dict(help=help, flag=flag, type=type, show_default=show_default))


def source_defaults(option: str) -> str:
    """Which sources read `option`, with their defaults, from the registry: "eagle [8], ddtree [4]"."""
    return ", ".join(
        f"{name} [{getattr(source.options(), option)}]"
        for name, source in DRAFTERS.items()
        if option in source.options.names()
    )


@dataclass(frozen=True)
class ModelConfig:
    path_or_hf_repo: Optional[str] = setting(
        None,
        "mlx-lm model: a directory or a Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct).",
        flag="--model",
    )
    revision: Optional[str] = setting(
        None, "The model's revision on the Hugging Face hub (branch, tag or commit)."
    )
    dtype: str = setting(
        "auto", "auto|float32|float16|bfloat16|keep. auto: quantized weights on a GPU, float32 on the CPU."
    )


@dataclass(frozen=True)
class DraftConfig:
    draft: str = setting(
        "lookup",
        f"Source of drafts: auto|{'|'.join(DRAFTERS)}. auto: the model's MTP module, "
        "else a drafter published for it (`mlx-spec drafters`), else suffix.",
    )
    draft_model: Optional[str] = setting(
        None,
        "Drafter checkpoint or draft model: a directory or a Hugging Face repo id "
        f"({sources_reading('draft_model').replace('|', ', ')}).",
    )
    download_drafter: bool = setting(
        False,
        "--draft auto: download the drafter published for the model when it "
        "is not in the Hugging Face cache, without asking.",
        flag="--yes",
        show_default=False,
    )
    num_draft_tokens: Optional[int] = setting(
        None,
        "Most drafts per step (default per method: "
        + ", ".join(f"{m} {s.default_draft_tokens}" for m, s in DRAFTERS.items() if s.default_draft_tokens)
        + ").",
        type=("IntRange", 0),
    )
    adaptive: bool = setting(
        True,
        "adaptive: verify only the drafts that pay, from their confidence and the costs "
        "measured while running (none when drafting does not pay); fixed: always "
        "--num-draft-tokens.",
        flag="--adaptive/--fixed",
    )
    stop_early: bool = setting(
        False,
        f"{sources_reading('stop_early').replace('|', ', ')} (chains): stop drafting "
        "once the next draft would not pay (a sync per draft).",
        show_default=False,
    )
    ngram_max: Optional[int] = setting(
        None, f"Longest n-gram matched: {source_defaults('ngram_max')}.", type=("IntRange", 1)
    )
    ngram_min: Optional[int] = setting(
        None, f"Shortest n-gram matched: {source_defaults('ngram_min')}.", type=("IntRange", 1)
    )
    tree_budget: Optional[int] = setting(
        None,
        f"Nodes of a draft tree (0: a chain of --num-draft-tokens): {source_defaults('tree_budget')}.",
        type=("IntRange", 0, 512),
    )
    tree_topk: Optional[int] = setting(
        None,
        "Children per expanded node (eagle), candidates per position: "
        f"{source_defaults('tree_topk')}. --num-draft-tokens is the tree's "
        "depth.",
        type=("IntRange", 1, 64),
    )
    suffix_memory: Optional[str] = setting(
        None,
        f"{sources_reading('suffix_memory').replace('|', ', ')}: the file of earlier outputs searched and fed "
        "(default: one per model under ~/.cache/mlx-spec/suffix-memory), or off.",
    )
    exit_layer: Optional[int] = setting(
        None, "layerskip: the target's first E layers (then its norm and head) draft.", type=("INT",)
    )

    def source_options(self, dtype: str, draft: Optional[str] = None) -> SourceOptions:
        """The typed options of the source (this one's, or `draft`) from the ones given; an option
        another source reads is refused in one line."""
        return source_options(
            draft or self.draft,
            dtype=dtype,
            **{name: getattr(self, name) for name in option_names()},
        )


@dataclass(frozen=True)
class SamplingConfig:
    temp: float = setting(0.0, "Sampling temperature.", type=("FLOAT",))
    top_p: float = setting(1.0, "Nucleus sampling.", type=("FLOAT",))
    top_k: int = setting(0, "Top-k sampling (0: off).", type=("INT",))
    min_p: float = setting(0.0, "Min-p sampling.", type=("FLOAT",))
    seed: Optional[int] = setting(
        None,
        "Random seed: the same seed gives the same sampled text, whatever --draft "
        "(default: a fresh one, printed with the statistics when sampling).",
        type=("INT",),
    )
    residual_sampling: bool = setting(
        False,
        "Accept sampled drafts by the residual rule (may accept more; the "
        "output for a seed then depends on the draft source and timing).",
        show_default=False,
    )

    def params(self):
        from .sampling import SamplingParams

        return SamplingParams(
            temp=float(self.temp), top_p=float(self.top_p), top_k=int(self.top_k), min_p=float(self.min_p)
        )


@dataclass(frozen=True)
class CacheConfig:
    max_kv_size: Optional[int] = setting(
        None,
        "Bound the KV cache: the first 4 tokens and a window of the latest (mlx-lm's RotatingKVCache; models "
        "that build their own cache keep it).",
        type=("IntRange", 8),
    )
    kv_bits: Optional[int] = setting(
        None,
        "Quantize the KV cache to this many bits (2, 3, 4, 5, 6, 8; default: no quantization), with --draft "
        "none: speculation over it would not print mlx-lm's tokens.",
        type=("INT",),
    )
    kv_group_size: int = setting(64, "Group size of the KV cache quantization (32, 64, 128).", type=("INT",))
    quantized_kv_start: int = setting(
        5000, "With --kv-bits, quantize the cache once it holds this many tokens.", type=("IntRange", 0)
    )

    def quantization(self):
        from .cache import KVQuantization

        return (
            KVQuantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)
            if self.kv_bits
            else None
        )


@dataclass(frozen=True)
class SplitConfig:
    sharding: Optional[str] = setting(
        None,
        "Split the target over the processes mlx.launch starts (mlx-lm's "
        "sharding: tensor parallel, pipeline stages, or auto: tensor where the "
        "heads split evenly, else pipeline); rank 0 drafts and prints.",
        type=("Choice", ["tensor", "pipeline", "auto"]),
    )
    rank_timeout: Optional[float] = setting(
        None,
        "With --sharding: seconds a pass (or a prefill chunk) may wait for "
        "the other ranks before the run ends [120].",
        type=("FloatRange", 1),
    )

    def __post_init__(self):
        if self.rank_timeout is not None and not self.sharding:
            raise MlxSpecError("--rank-timeout (rank_timeout) is for a split target: give --sharding too")


# The sections of EngineConfig, and the --help heading of each (None: the everyday options).
SECTIONS = {
    "model": (ModelConfig, None),
    "draft": (DraftConfig, "Drafting"),
    "sampling": (SamplingConfig, "Sampling"),
    "cache": (CacheConfig, "KV cache"),
    "split": (SplitConfig, "Split target"),
}
# Draft options listed with the everyday ones rather than under "Drafting".
EVERYDAY = {"draft", "draft_model"}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    sessions: bool = False  # keep what a server needs to switch conversations (Engine(sessions=True))

    @classmethod
    def of(cls, **settings) -> "EngineConfig":
        """A configuration from flat settings named as the CLI's destinations and api.load's
        keywords (None: not given, the default stands); an unknown name is refused in one line."""
        sections: Dict[str, dict] = {name: {} for name in SECTIONS}
        where = {f.name: section for section, (kind, _) in SECTIONS.items() for f in fields(kind)}
        sessions = bool(settings.pop("sessions", False))
        for name, value in settings.items():
            if name not in where:
                raise MlxSpecError(f"unknown argument {name!r}: mlx-spec takes {', '.join(sorted(where))}")
            if value is not None:
                sections[where[name]][name] = value
        return cls(
            **{section: SECTIONS[section][0](**values) for section, values in sections.items()},
            sessions=sessions,
        )

    def flat(self) -> Dict[str, Any]:
        """The settings by name, as `of` takes them."""
        return {
            f.name: getattr(getattr(self, section), f.name)
            for section, (kind, _) in SECTIONS.items()
            for f in fields(kind)
        }

    def with_draft(self, draft: str, **changes) -> "EngineConfig":
        """The same configuration with another draft source (bench's methods)."""
        return replace(self, draft=replace(self.draft, draft=draft, **changes))


def engine_settings(config: EngineConfig) -> dict:
    """Engine's keyword arguments of a configuration (the source's own options apart)."""
    draft, sampling = config.draft, config.sampling
    if draft.stop_early and not DRAFTERS[draft.draft].stops_early:
        raise MlxSpecError(
            f"--stop-early is for --draft {sources_reading('stop_early')}, not --draft {draft.draft}"
        )
    return dict(
        num_draft_tokens=draft_tokens(draft.draft, draft.num_draft_tokens),
        sampling=sampling.params(),
        seed=sampling.seed,
        residual=sampling.residual_sampling,
        adaptive=draft.adaptive,
        stop_early=draft.stop_early,
        sessions=config.sessions,
        kv_quantization=config.cache.quantization(),
        max_kv_size=config.cache.max_kv_size,
    )


def build_engine(target, config: EngineConfig, split=None, drafter=None):
    """The Engine of `config` over a loaded target (split: the SplitTarget it belongs to, on
    whose rank 0 the engine's passes are ordered on the other ranks first).
    config.draft.draft_model is a local directory here (api.load resolves repo ids). drafter:
    config's, already built (--draft auto builds one to check it)."""
    from .engine import Engine

    if drafter is None:
        drafter = make_drafter(config.draft.draft, target, config.draft.source_options(config.model.dtype))
    settings = engine_settings(config)
    return split.engine(drafter, **settings) if split is not None else Engine(target, drafter, **settings)
