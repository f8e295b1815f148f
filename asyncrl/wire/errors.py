"""Errors raised by the wire layer: the codec and every channel.

The channel errors follow one rule (after trio's channel errors): ``ChannelClosed`` means
*you* closed it, ``PeerLost`` means something outside broke it (the cause is kept in
``__cause__``), ``EndOfStream`` means the other side finished cleanly, and ``WouldBlock``
is what the ``*_nowait`` variants raise instead of waiting.
"""

from __future__ import annotations


class WireError(ValueError):
    """A frame or message could not be encoded or decoded.

    The message names the offending field (``WorkItem.credits``) or frame, so a dropped
    message can be traced to its producer from the log line alone.
    """


class FrameTooLarge(WireError):
    """A frame exceeds the configured ``max_frame_bytes`` (refused on send and on receive)."""


class ChannelClosed(RuntimeError):
    """The channel was closed by this side; no further send or receive is possible."""


class PeerLost(RuntimeError):
    """The peer stopped answering (timeout or socket error); ``__cause__`` holds why."""


class EndOfStream(Exception):
    """The peer closed its end cleanly; nothing more will arrive."""


class WouldBlock(Exception):
    """A ``*_nowait`` call could not complete without waiting."""


class RemoteError(RuntimeError):
    """A request handler on the other side raised; the text is the remote error message."""
