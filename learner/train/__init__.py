"""Training: from a batch of results to an updated policy.

Owns the trainer (:mod:`.trainer`) and its step statistics (:mod:`.step`), micro-batch plans
(:mod:`.batching`), advantages and returns (:mod:`.returns`), the reference model
(:mod:`.reference`), the critic (:mod:`.critic`), learning-rate schedules, devices, dropout, the
strategies the trainer is given (:mod:`.strategy`: plain; the DeepSpeed one in :mod:`.distributed`,
:mod:`.ds_state`, :mod:`.ds_config`, :mod:`.ds_group`), the policy's loading, optimizer and
publish contents (:mod:`.policy_io`), the publish layout of weights (:mod:`.weights`) and the
offline DPO trainer (:mod:`.dpo`). Never imports :mod:`learner.serve`: a trainer knows nothing of
sockets.
"""
