"""Models the learner builds itself (no download): see :mod:`learner.models.builtin`."""
