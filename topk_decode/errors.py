"""The one exception type users see: its message is printed on one line by the CLI."""


class TopkError(Exception):
    """An error caused by the user's input or environment, with a message that says how to fix it."""


class TopkWarning(UserWarning):
    """A condition the user should know about but that does not stop the work (printed as one line)."""
