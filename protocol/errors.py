"""The one exception type for bad wire input."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Raised for every malformed, mistyped, oversize or incompatible message.

    The message names the offending field (``"Sample.behavior_logprobs: ..."``) so that a log line
    is enough to find the sender's bug. Receivers count these and keep running.
    """
