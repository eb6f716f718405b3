"""The one exception type users see: a message that names the problem and the fix."""


class GhostLayersError(ValueError):
    """Bad input or an unsupported setup; the CLI prints the message without a traceback."""
