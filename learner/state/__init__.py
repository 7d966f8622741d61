"""What outlives the learner process: checkpoints and the trained-ids record
(:mod:`.checkpoint`) and the durable rollout log (:mod:`.rollout_log`).

Never imports :mod:`learner.serve` or :mod:`learner.train`: it persists the objects it is handed.
"""
