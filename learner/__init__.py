"""The learner process: it takes scored rollouts from the servers, trains on them and publishes
weights back (docs/design.md §1, §8).

It is built as wings, one job each; a wing imports only the wings below it (tests/test_layering.py):

    serve/    the service: sockets and their loops, admission, intake, routing, ctl, weights server
    train/    the trainer: one policy step, micro-batching, returns, reference, critic, DeepSpeed
    state/    what survives the process: checkpoints, the trained-ids record, the rollout log
    data/     prompts, the built-in tasks, evaluation
    models/   models the learner builds itself and the log-prob forward

Two are shared by every wing and import none: :mod:`learner.config` (the learner's
settings) and :mod:`learner.metrics` (its metric definitions).
"""
