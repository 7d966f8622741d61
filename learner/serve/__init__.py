"""The learner process: what talks to the outside while the trainer trains.

The process and its sockets' loops (:mod:`.service`, :mod:`.router`: the ROUTER loop and the
``RolloutLink`` port), which servers may take work (:mod:`.admission`), what they are offered
(:mod:`.offers`), results in and their Acks (:mod:`.ingress`, :mod:`.intake`, :mod:`.sample_watch`),
``slipstream ctl`` (:mod:`.control`), the weights server (:mod:`.weights_server`), CURVE on its
sockets (:mod:`.security`), what is written down about each step (:mod:`.step_records`,
:mod:`.sinks`) and what a stalled learner waits on (:mod:`.waiting`). The components are built by
the composition root, :mod:`learner.app`; the train loop is :mod:`learner.loop`.
"""
