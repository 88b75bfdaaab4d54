"""The registry of draft sources: a new source is one file here plus one line below.

Each entry carries everything about its source: the factory (the target and the CLI's options,
a dict -> a Drafter, or None for plain decoding) and the most drafts per step when
--num-draft-tokens is not given (the policy verifies fewer when they do not pay)."""

from dataclasses import dataclass
from typing import Callable, Tuple

from ..errors import MlxSpecError
from ..models.checkpoint import check_kind


def _none(target, options):
    return None


def _lookup(target, options):
    from .lookup import LookupDrafter

    return LookupDrafter(ngram_max=options.get("ngram_max", 3), ngram_min=options.get("ngram_min", 1))


def _draft_model(target, options):
    from ..models.target import load_target
    from .draft_model import DraftModelDrafter, check_same_vocabulary

    if not options.get("draft_model"):
        raise MlxSpecError("--draft model needs --draft-model PATH (a small mlx-lm model)")
    check_kind(options["draft_model"], "model")
    draft = load_target(options["draft_model"], options.get("dtype", "auto"))
    check_same_vocabulary(target, draft)
    return DraftModelDrafter(draft, target.vocab_size)


def _drafter_path(method: str, target, options: dict, what: str, shipped: str = None):
    """--draft-model, else the drafter shipped for the default model (the `shipped` one)."""
    from ..models.default import SHIPPED_DRAFTERS, shipped_drafter

    path = options.get("draft_model") or shipped_drafter(shipped or method, target.path)
    if not path:
        raise MlxSpecError(f"--draft {method} needs --draft-model PATH ({what}); one ships for the default "
                           f"model SmolLM2-135M-Instruct only: {SHIPPED_DRAFTERS / (shipped or method)}")
    check_kind(path, method)
    return path


def _dflash(target, options):
    from ..models.dflash import load_dflash
    from .dflash import DFlashDrafter

    model = load_dflash(_drafter_path("dflash", target, options, "a DFlash drafter directory"), target)
    return DFlashDrafter(target, model)


def _ddtree(target, options):
    from ..models.dflash import load_dflash
    from .ddtree import DDTreeDrafter

    model = load_dflash(_drafter_path("ddtree", target, options, "a DFlash drafter directory", "dflash"), target)
    return DDTreeDrafter(target, model, budget=options.get("tree_budget") or 16,
                         topk=options.get("tree_topk") or 4)


def _eagle(target, options):
    from ..models.eagle3 import load_eagle3
    from .eagle import EagleDrafter

    model = load_eagle3(_drafter_path("eagle", target, options, "an EAGLE-3 checkpoint directory"), target)
    return EagleDrafter(model, target.vocab_size, tree_budget=options.get("tree_budget", 0), tree_topk=options.get("tree_topk") or 8)


def _layerskip(target, options):
    from .layerskip import LayerSkipDrafter

    if options.get("exit_layer") is None:
        raise MlxSpecError(f"--draft layerskip needs --exit-layer E (1..{target.num_layers - 1}): the layers "
                           "that draft")
    return LayerSkipDrafter(target, options["exit_layer"])


def _medusa(target, options):
    from ..models.medusa import load_medusa
    from .medusa import MedusaDrafter

    model = load_medusa(_drafter_path("medusa", target, options, "a Medusa heads directory"), target)
    return MedusaDrafter(target, model, tree_budget=options.get("tree_budget") or 0,
                         tree_topk=options.get("tree_topk") or 4)


def _mtp(target, options):
    from ..models.mtp import find_mtp, load_mtp
    from .eagle import EagleDrafter

    if options.get("tree_budget"):
        raise MlxSpecError("--draft mtp drafts a chain: drop --tree-budget")
    if options.get("draft_model"):
        check_kind(options["draft_model"], "mtp")
    return EagleDrafter(load_mtp(find_mtp(target, options.get("draft_model")), target), target.vocab_size)


@dataclass(frozen=True)
class Source:
    make: Callable
    default_draft_tokens: int
    summary: str
    uses_draft_model: bool = True   # --draft-model means something to it
    options: Tuple[str, ...] = ()   # the other options of its own that it reads (make's dict keys)


# Lengths: lookup's and the learned drafters' bound what the policy may verify; a draft model
# drafts mlx-lm's 3.
TREE = ("tree_budget", "tree_topk")
DRAFTERS = {
    "none": Source(_none, 0, "plain decoding through the same loop", uses_draft_model=False),
    "lookup": Source(_lookup, 10, "n-grams of the prompt and output", uses_draft_model=False,
                     options=("ngram_max", "ngram_min")),
    "model": Source(_draft_model, 3, "a small model with the same tokenizer (--draft-model)", options=("stop_early",)),
    "dflash": Source(_dflash, 8, "DFlash block drafter"),
    "ddtree": Source(_ddtree, 8, "a tree from one DFlash block's distributions", options=TREE),
    "eagle": Source(_eagle, 4, "EAGLE-3 draft layer", options=TREE + ("stop_early",)),
    "layerskip": Source(_layerskip, 4, "the target's first --exit-layer layers draft", uses_draft_model=False,
                        options=("exit_layer",)),
    "medusa": Source(_medusa, 4, "Medusa heads on the target's last hidden state", options=TREE),
    "mtp": Source(_mtp, 3, "the target's multi-token-prediction module (DeepSeek, GLM, MiMo, Qwen3-Next)",
                  options=("stop_early",)),
}
# Options that only some sources read (the registry says which): given to another, refused.
SOURCE_OPTIONS = ("ngram_max", "ngram_min", "tree_budget", "tree_topk", "exit_layer", "stop_early")


def check_method(method: str) -> str:
    if method not in DRAFTERS:
        raise MlxSpecError(f"unknown draft method {method!r}: choose one of {', '.join(DRAFTERS)}")
    return method


def draft_tokens(method: str, num_draft_tokens=None) -> int:
    """--num-draft-tokens, else the method's default."""
    return DRAFTERS[check_method(method)].default_draft_tokens if num_draft_tokens is None else num_draft_tokens


def sources_reading(option: str) -> str:
    return "|".join(name for name, s in DRAFTERS.items() if option in s.options)


def make_drafter(method: str, target, options: dict):
    source = DRAFTERS[check_method(method)]
    if options.get("draft_model") and not source.uses_draft_model:
        users = "|".join(name for name, s in DRAFTERS.items() if s.uses_draft_model)
        raise MlxSpecError(f"--draft-model is for --draft {users}, not --draft {method}")
    return source.make(target, options)
