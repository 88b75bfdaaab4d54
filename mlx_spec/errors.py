"""The one exception type that the CLI turns into a one-line error and a non-zero exit."""


class MlxSpecError(Exception):
    """Bad input (missing/corrupt checkpoint, mismatched drafter, prompt too long, ...)."""


class RanksLost(MlxSpecError):
    """A split target (--sharding) cannot go on: a rank stopped, hangs or fell out of step.
    Commands that serve several requests end on it, not only the request."""
