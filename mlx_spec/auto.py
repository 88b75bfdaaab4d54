"""--draft auto: the draft source most likely to pay for the model a user names, chosen once,
before the first token, in this order:

1. the model's own multi-token-prediction module, where its checkpoint keeps one (DeepSeek,
   GLM, MiMo, Qwen3-Next, Qwen3.5: the original directory, or a conversion by `convert --hf-path`);
2. a drafter published for it (published_drafters.json), matched by the model's name as
   dflash-mlx's registry matches: case-insensitive, the organisation dropped, the longest
   registered name that is the model's name or its start followed by "-" or "_"
   (mlx-community/Qwen3-8B-4bit -> qwen3-8b); used where it is in the Hugging Face cache, or once
   downloaded (`--yes`, or a yes to the terminal's question; never offline); a drafter whose
   config names another target, or that does not fit the loaded model, is passed over in one line;
3. suffix decoding, with its memory of earlier outputs: it needs nothing and drafts chains where
   the model's cache cannot hold trees.

The choice and why it was made come back as a `Choice`, for the banners and --json."""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from .config import EngineConfig, build_engine
from .drafters import DRAFTERS, make_drafter, option_names
from .errors import MlxSpecError

REGISTRY = Path(__file__).with_name("published_drafters.json")
SPLIT_REFUSED = "--draft auto with --sharding: name the source (--draft suffix, --draft mtp, ...)"
# What auto may not be given: it picks the source, and the sources' options belong to one
# source or another; but for the suffix memory, which is the user's whichever source reads it.
SOURCE_OPTIONS = tuple(name for name in option_names() if name != "suffix_memory")


@dataclass(frozen=True)
class Published:
    target: str  # the repo id the drafter was trained for
    kind: str  # the --draft value that reads it
    repo: str  # the drafter's repo id
    notes: str = ""


@dataclass(frozen=True)
class Choice:
    draft: str  # the --draft value chosen
    draft_model: Optional[str]  # its checkpoint directory (None: the source needs none, or finds it)
    why: str  # one line: what was chosen and why
    # The drafter already built from draft_model (to check that it fits): the engine takes it.
    drafter: object = field(default=None, repr=False, compare=False)


def name_key(name: str) -> str:
    """A model's name as the registry compares it: lower case, without its organisation."""
    return str(name).rstrip("/").split("/")[-1].lower()


def registry() -> List[Published]:
    return [
        Published(target, **drafter)
        for target, drafters in json.loads(REGISTRY.read_text()).items()
        for drafter in drafters
    ]


def model_names(path) -> List[str]:
    """The names a model goes by: its repo id where it lies in the Hugging Face cache
    (models--ORG--NAME/snapshots/REV), and its directory's name."""
    path = Path(path)
    names = [
        f"{part[len('models--') :].replace('--', '/', 1)}"
        for part in path.parts
        if part.startswith("models--")
    ]
    return names + [path.name]


def _matches(key: str, name: str) -> bool:
    return name == key or (name.startswith(key) and name[len(key)] in "-_")


def published_for(names) -> List[Published]:
    """The drafters registered for the longest registered name that matches one of `names`
    (registry order: the one expected to pay most first)."""
    keys = [name_key(n) for n in names]
    entries = registry()
    matched = [e for e in entries if any(_matches(name_key(e.target), k) for k in keys)]
    if not matched:
        return []
    longest = max(len(name_key(e.target)) for e in matched)
    return [e for e in matched if len(name_key(e.target)) == longest]


def declared_target(config: dict) -> Optional[str]:
    """The target a drafter's config names, where it names one (the speculators format's
    verifier)."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") if isinstance(verifier, dict) else None


def _fetch(
    entry: Published, download: bool, confirm: Optional[Callable[[str], bool]], note
) -> Optional[Path]:
    """The drafter's directory: from the hub cache, or downloaded where allowed; None otherwise."""
    from .hub import cached, offline, resolve

    path = cached(entry.repo)
    if path is not None:
        return path
    if offline():
        note(
            f"{entry.repo} (--draft {entry.kind}) is registered for this model but not in the Hugging Face cache, "
            "and HF_HUB_OFFLINE is set"
        )
        return None
    if not download and not (
        confirm
        and confirm(
            f"Download {entry.repo}, a {entry.kind} drafter for this model, from the Hugging Face hub?"
        )
    ):
        note(f"{entry.repo} (--draft {entry.kind}) is registered for this model: --yes downloads it")
        return None
    return resolve(entry.repo, None, "drafter")


def _fits(entry: Published, path: Path, target, names, dtype: str):
    """(why the drafter at `path` is not for this target, None; or None, the drafter built from
    it): the target its config names, else what its loader refuses (hidden size, layers,
    vocabulary)."""
    from .models.checkpoint import read_config

    declared = declared_target(read_config(path, "drafter"))
    if declared and not any(_matches(name_key(declared), name_key(n)) for n in names):
        return f"its config names the target {declared}", None
    try:
        return None, make_drafter(entry.kind, target, {"draft_model": str(path), "dtype": dtype})
    except MlxSpecError as e:
        return str(e), None


def choose(
    target,
    config: EngineConfig,
    confirm: Optional[Callable[[str], bool]] = None,
    note: Callable[[str], None] = lambda line: print(f"mlx-spec: {line}", file=sys.stderr),
) -> Choice:
    """The source --draft auto runs for `target`. confirm(question): may a drafter not in the
    cache be downloaded (None: only with config.draft.download_drafter); note(line): where
    what was passed over is said."""
    from .models.mtp import own_mtp_module

    given = [name for name in SOURCE_OPTIONS if getattr(config.draft, name) is not None]
    if given:
        raise MlxSpecError(
            f"--draft auto picks the source and its drafter: drop --{given[0].replace('_', '-')}, "
            "or name the source with --draft"
        )
    if config.split.sharding:
        raise MlxSpecError(SPLIT_REFUSED)
    if target.path and own_mtp_module(target) is not None:
        return Choice("mtp", None, "the model's own MTP module")
    names = model_names(target.path) if target.path else []
    for entry in published_for(names):
        path = _fetch(entry, config.draft.download_drafter, confirm, note)
        if path is None:
            continue
        why_not, drafter = _fits(entry, path, target, names, config.model.dtype)
        if why_not:
            note(
                f"{entry.repo} is registered for {entry.target} but does not fit this model ({why_not}): passed over"
            )
            continue
        return Choice(entry.kind, str(path), f"{entry.repo}, published for {entry.target}", drafter)
    return Choice("suffix", None, "no MTP module and no published drafter in the cache for this model")


def auto_engine(target, config: EngineConfig, confirm=None, note=None):
    """(engine, choice) of --draft auto."""
    choice = choose(target, config, confirm, **({"note": note} if note else {}))
    source = DRAFTERS[choice.draft]  # --suffix-memory and --stop-early where the choice reads them
    chosen = config.with_draft(
        choice.draft,
        draft_model=choice.draft_model,
        suffix_memory=config.draft.suffix_memory if "suffix_memory" in source.options.names() else None,
        stop_early=config.draft.stop_early and source.stops_early,
    )
    return build_engine(target, chosen, drafter=choice.drafter), choice
