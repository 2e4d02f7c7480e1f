"""Errors that say what is wrong and what to do."""


class NNterpError(Exception):
    """Base class of the library's own errors."""


class ValueUnavailable(NNterpError, AttributeError):
    """A standard value that has no meaning on this block (``hasattr`` is False)."""

    def __init__(self, key: str, family: str, reason: str):
        self.key, self.family, self.reason = key, family, reason
        NNterpError.__init__(
            self,
            f"'{key}' is unavailable on {family}: {reason}. "
            "See model.availability(i) for the values this block has."
        )


class UnknownArchitecture(NNterpError, ValueError):
    """No family spec covers the model."""


class UnsupportedConfig(NNterpError, ValueError):
    """The family is known, but this configuration has no standard residual stream."""


class BadAssignment(NNterpError, ValueError):
    """A value was assigned a tensor of the wrong shape or type."""


class RunNotChosen(NNterpError, ValueError):
    """A value of a block that runs several times in each forward pass, read without saying which run."""


class ReadoutUnavailable(NNterpError, ValueError):
    """No one stream can be read out as the model reads its last block's output (``project_on_vocab``, the lens)."""
