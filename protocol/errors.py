"""The exceptions every process uses: bad wire input, and a start that cannot work as configured."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Raised for every malformed, mistyped, oversize or incompatible message.

    The message names the offending field (``"Sample.behavior_logprobs: ..."``) so that a log line
    is enough to find the sender's bug. Receivers count these and keep running.
    """


class StartupError(RuntimeError):
    """A process cannot start as configured (a port in use, a bad endpoint, a missing file).

    The message is one line that says what to fix; the CLI prints it and exits with code 2.
    """
