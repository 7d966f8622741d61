"""What the learner asks: the prompt stream (:mod:`.prompts`), the built-in tasks (:mod:`.tasks`)
and held-out evaluation rounds (:mod:`.evaluation`).

Never imports :mod:`learner.serve`, :mod:`learner.train` or :mod:`learner.state`.
"""
