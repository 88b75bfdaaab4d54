"""The one exception type that the CLI turns into a one-line error and a non-zero exit."""


class MlxSpecError(Exception):
    """Bad input (missing/corrupt checkpoint, mismatched drafter, prompt too long, ...)."""
