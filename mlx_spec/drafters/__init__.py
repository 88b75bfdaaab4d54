"""The registry of draft sources: a new source is one file here plus one line below.

Each entry carries everything about its source: the factory (the target and the source's typed
options -> a Drafter, or None for plain decoding), the options it reads with their defaults
(the CLI's help reads them), the most drafts per step when --num-draft-tokens is not given
(the policy verifies fewer when they do not pay), and for a learned source the kind of
checkpoint it reads, its loader (convert --drafter), the drafter shipped for the default model
and its trainer; what other parts list per source (the kinds a checkpoint may be, the train
commands, the shipped drafters) is read from here."""

from dataclasses import dataclass, fields
from typing import Callable, Optional, Type, Union

from ..errors import MlxSpecError
from ..models.checkpoint import KINDS, checkpoint_kind, read_config


@dataclass(frozen=True)
class SourceOptions:
    """What a source reads besides the target; subclasses add their fields and defaults."""

    dtype: str = "auto"  # the target's --dtype, which a draft model follows

    @classmethod
    def names(cls) -> set:
        return {f.name for f in fields(cls)} - {"dtype"}


@dataclass(frozen=True)
class LookupOptions(SourceOptions):
    ngram_max: int = 3  # longest n-gram matched
    ngram_min: int = 1  # shortest


@dataclass(frozen=True)
class CheckpointOptions(SourceOptions):
    draft_model: Optional[str] = None  # a directory (api.load resolves repo ids)


@dataclass(frozen=True)
class EagleOptions(CheckpointOptions):
    tree_budget: int = 0  # nodes of an EAGLE-2 dynamic tree; 0: a chain
    tree_topk: int = 8  # children per expanded node


@dataclass(frozen=True)
class DDTreeOptions(CheckpointOptions):
    tree_budget: int = 16  # the most nodes
    tree_topk: int = 4  # candidates per position

    def __post_init__(self):
        if self.tree_budget < 1:
            raise MlxSpecError(f"--draft ddtree needs --tree-budget >= 1, got {self.tree_budget}")


@dataclass(frozen=True)
class MedusaOptions(CheckpointOptions):
    tree_budget: int = 0  # nodes of a tree from the heads' top tokens; 0: a chain
    tree_topk: int = 4  # candidates per head


@dataclass(frozen=True)
class SuffixOptions(SourceOptions):
    tree_budget: int = 16  # the most nodes of a draft tree; 0: a chain
    suffix_memory: Optional[str] = None  # the memory of earlier outputs: a file, "off"; None: the model's


@dataclass(frozen=True)
class SuffixPlusOptions(SuffixOptions):
    draft_model: Optional[str] = None  # the learned drafter's checkpoint


@dataclass(frozen=True)
class LayerSkipOptions(SourceOptions):
    exit_layer: Optional[int] = None  # the target's first E layers draft (required)


def _none(target, options):
    return None


def _lookup(target, options: LookupOptions):
    from .lookup import LookupDrafter

    return LookupDrafter(ngram_max=options.ngram_max, ngram_min=options.ngram_min)


def _suffix(target, options: SuffixOptions):
    from ..cache import holds_trees, make_cache
    from ..suffix_memory import open_memory
    from .suffix import SuffixDrafter

    # Trees where the target's cache holds them; a chain of the tree's best path elsewhere.
    return SuffixDrafter(
        options.tree_budget,
        open_memory(target, options.suffix_memory),
        tree=holds_trees(make_cache(target.model)),
    )


def _suffix_plus(learned: str):
    """suffix+`learned`: a suffix drafter beside the learned source's (drafters/combined.py)."""

    def make(target, options: SuffixPlusOptions):
        from .combined import Combined

        source = DRAFTERS[learned]
        learned_options = source.options(draft_model=options.draft_model, dtype=options.dtype)
        return Combined(
            _suffix(target, options), source.make(target, learned_options), source.default_draft_tokens
        )

    return make


def _draft_model(target, options: CheckpointOptions):
    from ..models.target import load_target
    from .draft_model import DraftModelDrafter, check_same_vocabulary

    if not options.draft_model:
        raise MlxSpecError(
            "--draft model needs a draft model: --draft-model PATH (Python: draft_model=PATH), "
            "a small mlx-lm model with the target's tokenizer"
        )
    check_kind(options.draft_model, "model")
    draft = load_target(options.draft_model, options.dtype)
    check_same_vocabulary(target, draft)
    return DraftModelDrafter(draft, target.vocab_size)


def _drafter_path(method: str, target, options: CheckpointOptions, what: str):
    """--draft-model, else the drafter shipped for the default model (the source's `shipped`)."""
    from ..models.default import SHIPPED_DRAFTERS, shipped_drafter

    shipped = DRAFTERS[method].shipped
    path = options.draft_model or shipped_drafter(shipped, target.path)
    if not path:
        raise MlxSpecError(
            f"--draft {method} needs a drafter: --draft-model PATH (Python: draft_model=PATH), "
            f"{what}; one ships for the default model SmolLM2-135M-Instruct only: "
            f"{SHIPPED_DRAFTERS / shipped}"
        )
    check_kind(path, method)
    return path


def _dflash(target, options: CheckpointOptions):
    from ..models.dflash import load_dflash
    from .dflash import DFlashDrafter

    model = load_dflash(_drafter_path("dflash", target, options, "a DFlash drafter directory"), target)
    return DFlashDrafter(target, model)


def _ddtree(target, options: DDTreeOptions):
    from ..models.dflash import load_dflash
    from .ddtree import DDTreeDrafter

    model = load_dflash(_drafter_path("ddtree", target, options, "a DFlash drafter directory"), target)
    return DDTreeDrafter(target, model, budget=options.tree_budget, topk=options.tree_topk)


def _eagle(target, options: EagleOptions):
    from ..models.eagle3 import load_eagle3
    from .eagle import EagleDrafter

    model = load_eagle3(_drafter_path("eagle", target, options, "an EAGLE-3 checkpoint directory"), target)
    return EagleDrafter(
        model, target.vocab_size, tree_budget=options.tree_budget, tree_topk=options.tree_topk
    )


def _layerskip(target, options: LayerSkipOptions):
    from .layerskip import LayerSkipDrafter

    if options.exit_layer is None:
        raise MlxSpecError(
            f"--draft layerskip needs --exit-layer E (1..{target.num_layers - 1}): the layers that draft"
        )
    return LayerSkipDrafter(target, options.exit_layer)


def _medusa(target, options: MedusaOptions):
    from ..models.medusa import load_medusa
    from .medusa import MedusaDrafter

    model = load_medusa(_drafter_path("medusa", target, options, "a Medusa heads directory"), target)
    return MedusaDrafter(target, model, tree_budget=options.tree_budget, tree_topk=options.tree_topk)


def _mtp(target, options: CheckpointOptions):
    from ..models.mtp import find_mtp, load_mtp
    from .eagle import EagleDrafter

    if options.draft_model:
        check_kind(options.draft_model, "mtp")
    return EagleDrafter(load_mtp(find_mtp(target, options.draft_model), target), target.vocab_size)


def _load_dflash(path, target):
    from ..models.dflash import load_dflash

    return load_dflash(path, target)


def _load_eagle3(path, target):
    from ..models.eagle3 import load_eagle3

    return load_eagle3(path, target)


def _load_medusa(path, target):
    from ..models.medusa import load_medusa

    return load_medusa(path, target)


@dataclass(frozen=True)
class Source:
    make: Callable
    default_draft_tokens: int
    summary: str
    options: Type[SourceOptions] = SourceOptions
    stops_early: bool = False  # drafts one position at a time, so --stop-early can stop it
    checkpoint: Optional[str] = None  # the kind of checkpoint its --draft-model is (models.checkpoint.KINDS)
    load: Optional[Callable] = None  # (directory, target) -> its model, checked against the target
    shipped: Optional[str] = (
        None  # the drafter shipped for the default model it reads (mlx_spec/shipped/NAME)
    )
    trainer: Optional[str] = None  # its trainer, the module mlx_spec.train.NAME (`mlx-spec train NAME`)


# Lengths: lookup's and the learned drafters' bound what the policy may verify; a draft model
# drafts mlx-lm's 3.
DRAFTERS = {
    "none": Source(_none, 0, "plain decoding through the same loop"),
    "lookup": Source(_lookup, 10, "n-grams of the prompt and output", LookupOptions),
    "suffix": Source(
        _suffix,
        12,
        "a tree of what followed the context's suffix, in the prompt, the output "
        "and earlier outputs (--suffix-memory)",
        SuffixOptions,
    ),
    "model": Source(
        _draft_model,
        3,
        "a small model with the same tokenizer (--draft-model)",
        CheckpointOptions,
        stops_early=True,
        checkpoint="model",
    ),
    "dflash": Source(
        _dflash,
        8,
        "DFlash block drafter",
        CheckpointOptions,
        checkpoint="dflash",
        load=_load_dflash,
        shipped="dflash",
        trainer="dflash",
    ),
    "ddtree": Source(
        _ddtree,
        8,
        "a tree from one DFlash block's distributions",
        DDTreeOptions,
        checkpoint="dflash",
        load=_load_dflash,
        shipped="dflash",
    ),
    "eagle": Source(
        _eagle,
        4,
        "EAGLE-3 draft layer",
        EagleOptions,
        stops_early=True,
        checkpoint="eagle",
        load=_load_eagle3,
        shipped="eagle",
        trainer="eagle",
    ),
    "layerskip": Source(_layerskip, 4, "the target's first --exit-layer layers draft", LayerSkipOptions),
    "medusa": Source(
        _medusa,
        4,
        "Medusa heads on the target's last hidden state",
        MedusaOptions,
        checkpoint="medusa",
        load=_load_medusa,
        shipped="medusa",
        trainer="medusa",
    ),
    "mtp": Source(
        _mtp,
        3,
        "the target's multi-token-prediction module (DeepSeek, GLM, MiMo, Qwen3-Next)",
        CheckpointOptions,
        stops_early=True,
        checkpoint="model",  # its MTP weights, in a model's directory
        shipped="mtp",
        trainer="mtp",
    ),
}
DRAFTERS.update(
    {
        f"suffix+{learned}": Source(
            _suffix_plus(learned),
            12,
            f"suffix, and {learned} where the suffix match is weak",
            SuffixPlusOptions,
            stops_early=learned != "dflash",
        )
        for learned in ("eagle", "mtp", "dflash")
    }
)


def check_kind(path, method: str) -> None:
    """A one-line error when the checkpoint at `path` is not of the kind --draft `method` reads,
    naming what it is and the --draft values that read it."""
    kind = checkpoint_kind(read_config(path, "--draft-model"))
    if kind is None or DRAFTERS[method].checkpoint == kind:
        return
    methods = [name for name, source in DRAFTERS.items() if source.checkpoint == kind]
    fits = f"use --draft {' or --draft '.join(methods)}" if methods else "no --draft source reads it yet"
    raise MlxSpecError(f"{path} is {KINDS[kind]}, not what --draft {method} needs: {fits}")


def loaders() -> dict:
    """checkpoint kind -> its loader, of the kinds `convert --drafter` converts."""
    return {source.checkpoint: source.load for source in DRAFTERS.values() if source.load}


def trainers() -> dict:
    """source -> its trainer module's name (`mlx-spec train NAME`)."""
    return {name: source.trainer for name, source in DRAFTERS.items() if source.trainer}


def check_method(method: str) -> str:
    if method not in DRAFTERS:
        raise MlxSpecError(f"unknown draft method {method!r}: choose one of {', '.join(DRAFTERS)}")
    return method


def draft_tokens(method: str, num_draft_tokens=None) -> int:
    """--num-draft-tokens, else the method's default."""
    return (
        DRAFTERS[check_method(method)].default_draft_tokens if num_draft_tokens is None else num_draft_tokens
    )


def option_names() -> tuple:
    """Every option some source reads, in the order DRAFTERS first declares them."""
    names = [f.name for source in DRAFTERS.values() for f in fields(source.options) if f.name != "dtype"]
    return tuple(dict.fromkeys(names))


def sources_reading(option: str) -> str:
    """The sources that read `option` ("stop_early": those that stop early), as --draft a|b."""
    return "|".join(
        name
        for name, s in DRAFTERS.items()
        if (s.stops_early if option == "stop_early" else option in s.options.names())
    )


def source_options(method: str, **given) -> SourceOptions:
    """The typed options of --draft `method` from the ones given (None: not given, the default
    stands). An option of another source is refused in one line; names no source reads are
    left aside, as mlx-lm's from_dict does."""
    source = DRAFTERS[check_method(method)]
    known = option_names()
    for name, value in given.items():
        if value is not None and name in known and name not in source.options.names():
            chain = (
                ", which drafts a chain"
                if name.startswith("tree_") and "tree_budget" not in source.options.names()
                else ""
            )
            raise MlxSpecError(
                f"--{name.replace('_', '-')} is for --draft {sources_reading(name)}, "
                f"not --draft {method}{chain}"
            )
    return source.options(
        **{k: v for k, v in given.items() if v is not None and k in source.options.names() | {"dtype"}}
    )


def make_drafter(method: str, target, options: Union[SourceOptions, dict]):
    """The drafter of --draft `method` for `target` (None for plain decoding); options typed,
    or a dict of them (source_options)."""
    if isinstance(options, dict):
        options = source_options(method, **options)
    return DRAFTERS[check_method(method)].make(target, options)
