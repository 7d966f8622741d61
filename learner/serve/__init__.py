"""The learner's service: what talks to the outside while the trainer trains.

Owns the ROUTER sockets and their loops (:mod:`.router`), the service that ties the wings together
(:mod:`.service`), which servers may take work (:mod:`.admission`), checking and batching results
(:mod:`.intake`), ``slipstream ctl`` (:mod:`.control`), the weights server (:mod:`.weights_server`),
CURVE on its sockets (:mod:`.security`), metric sinks (:mod:`.sinks`) and the adaptive staleness
controller (:mod:`.staleness`). The only wing that may import every other.
"""
