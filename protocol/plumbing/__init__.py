"""Process plumbing the learner, the rollout servers and ``slipstream ctl`` share: not the wire format.

    process.py  one-line JSON event log, task supervision, fsync by name, the cycle trace
    http.py     the ``/metrics`` + ``/healthz`` HTTP endpoint (standard library only)
    curve.py    CURVE keys, allow-lists and the ZAP authenticator for the learner's sockets
    sockets.py  ZeroMQ socket setup: LINGER, high-water marks, MAXMSGSIZE, CURVE, bind errors

What travels between processes (messages, codec, validation, versions) is the rest of
``protocol`` (docs/design.md §6); nothing here defines or reads a message. The same import rule
holds: the standard library, pyzmq and ``protocol`` itself, never torch (docs/design.md §2).
"""
