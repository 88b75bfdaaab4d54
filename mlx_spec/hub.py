"""Model names: a local directory, or a Hugging Face repo id resolved the way mlx-lm resolves it
(huggingface_hub's cache, HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE honoured).

Only what a model or drafter needs is fetched: config and tokenizer files, safetensors weights.
Never code (`*.py`) nor pickled weights: mlx-spec executes nothing that comes with a checkpoint."""

import os
import re
from pathlib import Path
from typing import Optional

from .errors import MlxSpecError

ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_repo_id(name: str) -> bool:
    """`org/name` as the hub spells it (not ./x, /x, ~/x, a/b/c)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name


def offline() -> bool:
    """Whether HF_HUB_OFFLINE forbids reaching the hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve(name, revision: Optional[str] = None, what: str = "model") -> Path:
    """The local directory of `name`: an existing path as it is, else a hub repo id downloaded
    into (or, offline, read from) the hub cache. `what` names it in errors."""
    path = Path(name).expanduser()
    if path.exists():
        if revision is not None:
            raise MlxSpecError(f"--revision is for Hugging Face repo ids, and {name} is a local path")
        return path
    if not is_repo_id(str(name)):
        raise MlxSpecError(
            f"{what} not found: {name} is neither a directory nor a Hugging Face repo id (org/name)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision}" if revision else ""
    try:
        return Path(snapshot_download(str(name), revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise MlxSpecError(
            f"{what} {name} is gated on the Hugging Face hub: accept its terms on the "
            "hub, then log in (`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise MlxSpecError(
            f"{what} {name} is not on the Hugging Face hub (or is private: log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise MlxSpecError(f"{what} {name} has no revision {revision}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else "the hub could not be reached"
        raise MlxSpecError(
            f"{what} {name}{at} is not in the Hugging Face cache and {why}: download it "
            f"once online (`hf download {name}{' --revision ' + revision if revision else ''}`), "
            "or give a local directory"
        ) from None
    except OSError as e:  # network and disk errors
        raise MlxSpecError(
            f"cannot fetch {what} {name}{at}: {str(e).splitlines()[0] if str(e) else e}"
        ) from None


def cached(repo_id: str) -> Optional[Path]:
    """The directory of `repo_id` in the Hugging Face cache, None where it is not there (nothing
    is fetched)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
