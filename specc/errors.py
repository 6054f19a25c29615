"""The one error type users see: its message is a single sentence, printed without a traceback."""


class SpeccError(Exception):
    """A user-facing failure (bad input, missing file, unsupported model) with a one-sentence message."""
