"""The one exception type users see: its message is printed on one line by the CLI."""


class TopkError(Exception):
    """An error caused by the user's input or environment, with a message that says how to fix it."""


class NonFiniteLogits(TopkError):
    """A decode step's logits were not finite even on the exact path (engine.py): the cache or the model is
    broken. A TopkError, so the CLI prints it on one line; the server answers it as its own failure (500)."""


class TopkWarning(UserWarning):
    """A condition the user should know about but that does not stop the work (printed as one line)."""


class StepCancelled(Exception):
    """A decoding step stopped early because its conversation's `should_stop` said so; the conversation
    is left as it was before the step (not a user error: a caller that set `should_stop` expects it)."""
