"""The learner's ``security`` config block and the CURVE setup of its sockets (protocol.plumbing.curve).

    learner:
      security:
        curve: true
        secret_key_file: /keys/learner.key_secret     # the learner's key pair
        allowed_clients_dir: /keys/clients            # *.key of the rollout servers
        control_allowed_dir: /keys/operators          # *.key of who may run `slipstream ctl`

The rollout and weights sockets share the ``clients`` allow-list (a rollout server uses both);
the control socket has its own (``control_allowed_dir``; unset, it is the clients' one), so the
servers' keys need not be able to change settings or stop the run.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from learner.config import LearnerSecurity
from protocol.plumbing.curve import AllowList, Authenticator, CurveServer, load_key_pair

SOCKETS = ("rollout", "weights", "control")
"""The learner's CURVE sockets; each is its own ZAP domain (so refusals are counted per socket)."""




class LearnerCurve:
    """The learner's key pair, the allow-lists and the running ZAP handler (``security.curve``).

    ``on_denied(socket)`` is called for every client key refused on that socket."""

    def __init__(self, cfg: LearnerSecurity, ctx: zmq.Context, on_denied: Callable[[str], None]):
        self.public_key, secret = load_key_pair(cfg.secret_key_file, "learner.security.secret_key_file")
        clients = AllowList(cfg.allowed_clients_dir, "learner.security.allowed_clients_dir", on_denied)
        control = (AllowList(cfg.control_allowed_dir, "learner.security.control_allowed_dir", on_denied)
                   if cfg.control_allowed_dir else clients)
        self._servers = {name: CurveServer(self.public_key, secret, name) for name in SOCKETS}
        self.authenticator = Authenticator(ctx, {"rollout": clients, "weights": clients,
                                                 "control": control})

    def server(self, socket_name: str) -> CurveServer:
        """The CURVE options of the learner socket ``socket_name``."""
        return self._servers[socket_name]

    def close(self) -> None:
        self.authenticator.stop()
