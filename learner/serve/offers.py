"""What the learner hands rollout servers: the ``Welcome`` that answers a Hello and the fresh
assignments, drawn from the prompt stream (learner.serve.admission's ``Offers`` port).

Ids are ``<run_id>-a<n>`` from the run state's assignment counter (learner.state.run_state). After
a resume with a rollout log, the ids (and prompts) an earlier life handed out and the log
restored are passed over (``LearnerRolloutLog.passed_over``), so no id is handed out twice.
"""

from __future__ import annotations

import os
from typing import Any

import protocol
from learner.state.run_state import RunState


class LearnerOffers:
    """``cfg``: the learner config (``batch.group_size``, ``sampling``, ``servers.lease_timeout_s``,
    read at each assignment: ``ctl set sampling.temperature`` applies to every assignment issued
    from then on); ``weights``: the weights server (its kind, in the Welcome); ``endpoints``: the
    process's endpoints (the weights socket's, once bound). :attr:`prompts` is attached once the
    tokenizer has made it (learner.data.prompts.PromptSource)."""

    def __init__(self, cfg: Any, run: RunState, weights: Any, endpoints: dict[str, str],
                 rollout_log: Any = None):
        self.cfg, self.run, self.weights, self.endpoints = cfg, run, weights, endpoints
        self.rollout_log = rollout_log
        self.prompts: Any = None
        self.learner_id = f"learner-{os.getpid()}"

    def welcome(self) -> protocol.Welcome:
        return protocol.Welcome(learner_id=self.learner_id, run_id=self.run.run_id,
                                version=self.run.version, weights_endpoint=self.endpoints["weights"],
                                weights_kind=self.weights.kind)

    def sampling(self) -> protocol.SamplingParams:
        s = self.cfg.sampling
        return protocol.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=0,
                                       max_new_tokens=s.max_new_tokens, stop=list(s.stop),
                                       stop_token_ids=list(s.stop_token_ids),
                                       max_turns=s.max_turns,
                                       max_episode_tokens=s.episode_tokens if s.max_turns > 1 else None)

    def next_assignment(self) -> protocol.Assignment | None:
        run = self.run
        p = next(self.prompts, None)
        while self.rollout_log is not None and p is not None:   # ids (and prompts) restored
            skip_id, skip_prompt = self.rollout_log.passed_over(
                f"{run.run_id}-a{run.assignment_counter + 1}", p["prompt_token_ids"])
            if not skip_id:
                break
            run.assignment_counter += 1
            if skip_prompt:
                p = next(self.prompts, None)
        if p is None:
            return None                       # a finite dataset is used up (learner.data.prompts)
        run.assignment_counter += 1
        sampling = self.sampling()
        if self.cfg.sampling.seed_per_assignment:
            sampling.seed = (self.cfg.seed * 1_000_003 + run.assignment_counter) % (protocol.SEED_MAX + 1)
        return protocol.Assignment(
            assignment_id=f"{run.run_id}-a{run.assignment_counter}", prompt_id=p["prompt_id"],
            prompt_token_ids=p["prompt_token_ids"], group_size=self.cfg.batch.group_size,
            version=run.version, prompt_text=p["prompt"], sampling=sampling,
            metadata={**({"answer": p["answer"]} if p["answer"] is not None else {}), **p.get("metadata", {}),
                      **({protocol.BUCKET_KEY: p["bucket"]} if "bucket" in p else {})},
            deadline_s=self.cfg.servers.lease_timeout_s)
