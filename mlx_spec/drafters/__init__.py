"""The registry of draft sources: a new source is one file here plus one line below.

Each factory takes the target and the CLI's options (a dict) and returns a Drafter, or None for
plain decoding."""

from ..errors import MlxSpecError


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
    draft = load_target(options["draft_model"], options.get("dtype", "auto"))
    check_same_vocabulary(target, draft)
    return DraftModelDrafter(draft, options["sampling"], target.vocab_size, options.get("seed", 0))


def _drafter_path(method: str, target, options: dict, what: str):
    """--draft-model, else the drafter shipped for the default model."""
    from ..models.default import shipped_drafter

    path = options.get("draft_model") or shipped_drafter(method, target.path)
    if not path:
        raise MlxSpecError(f"--draft {method} needs --draft-model PATH ({what}); one ships only for "
                           "the default model")
    return path


def _dflash(target, options):
    from ..models.dflash import load_dflash
    from .dflash import DFlashDrafter

    model = load_dflash(_drafter_path("dflash", target, options, "a DFlash drafter directory"), target)
    return DFlashDrafter(target, model, options["sampling"], options.get("seed", 0))


def _eagle(target, options):
    from ..models.eagle3 import load_eagle3
    from .eagle import EagleDrafter

    model = load_eagle3(_drafter_path("eagle", target, options, "an EAGLE-3 checkpoint directory"), target)
    return EagleDrafter(model, options["sampling"],
                        target.vocab_size, options.get("seed", 0),
                        tree_budget=options.get("tree_budget", 0), tree_topk=options.get("tree_topk", 8))


DRAFTERS = {
    "none": _none,
    "lookup": _lookup,
    "model": _draft_model,
    "dflash": _dflash,
    "eagle": _eagle,
}


# Drafts per step when --num-draft-tokens is not given: the length that was fastest for the
# drafters shipped for the default model (README), mlx-lm's 3 for a draft model, and a long
# bound for lookup, which picks its own length per step.
DEFAULT_DRAFT_TOKENS = {"none": 0, "lookup": 10, "model": 3, "dflash": 4, "eagle": 2}


def check_method(method: str) -> str:
    if method not in DRAFTERS:
        raise MlxSpecError(f"unknown draft method {method!r}: choose one of {', '.join(DRAFTERS)}")
    return method


def draft_tokens(method: str, num_draft_tokens=None) -> int:
    """--num-draft-tokens, else the method's default."""
    return DEFAULT_DRAFT_TOKENS[check_method(method)] if num_draft_tokens is None else num_draft_tokens


def make_drafter(method: str, target, options: dict):
    return DRAFTERS[check_method(method)](target, options)
