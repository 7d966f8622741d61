"""Evaluation rounds without sockets or a model: a real Admission and RolloutBuffer, a recording
``send`` and a fake clock (as tests/learner/serve/test_admission.py). Gate capacity is untouched by eval
work; its leases expire, are re-issued, run out of attempts; results are checked and scored."""

from __future__ import annotations

import numpy as np
import pytest
from config_kit import nested
from learner_testkit import samples_for

import protocol
from buffer import RolloutBuffer
from learner.config import LearnerConfig, ServersSettings
from learner.data.evaluation import Evaluation
from learner.metrics import LearnerMetrics
from learner.models.builtin import build_tokenizer
from learner.serve.admission import Admission


class Harness:
    def __init__(self, prompts: int = 2, lease_timeout_s: float = 10.0):
        self.now = 1000.0
        self.clock = lambda: self.now
        self.buffer = RolloutBuffer(batch_samples=4, group_size=2, max_staleness=1, clock=self.clock)
        self.metrics = LearnerMetrics()
        self.version = 0
        self.sent: list[tuple[bytes, protocol.Message]] = []
        self.rows: list[dict] = []
        self.log: list[tuple[str, dict]] = []
        self.n = 0
        log = lambda event, **f: self.log.append((event, f))      # noqa: E731
        self.adm = Admission(self.buffer, self, self, version=lambda: self.version, servers=ServersSettings(),
                             metrics=self.metrics, log=log, clock=self.clock)
        items = [{"prompt_id": f"e{i}", "prompt": f"q{i}", "answer": str(i), "metadata": {"k": i},
                  "prompt_token_ids": np.array([1, 5 + i], np.int32)} for i in range(prompts)]
        self.ev = Evaluation(items, prefix="run-e", every=2, version=lambda: self.version,
                             sampling=protocol.SamplingParams(temperature=1e-6, max_new_tokens=4),
                             metrics=self.metrics, record=self.rows.append, log=log,
                             lease_timeout_s=lease_timeout_s, clock=self.clock,
                             distrusted=self.adm.distrusted)
        self.adm.side_work = self.ev

    def welcome(self) -> protocol.Welcome:
        return protocol.Welcome(learner_id="L", run_id="run", version=self.version,
                                weights_endpoint="tcp://127.0.0.1:1")

    async def send(self, identity: bytes, msg: protocol.Message) -> bool:
        self.sent.append((identity, msg))
        return True

    def next_assignment(self) -> protocol.Assignment:
        self.n += 1
        return protocol.Assignment(assignment_id=f"run-a{self.n}", prompt_id=f"p{self.n}",
                                   prompt_token_ids=np.array([1, 2], np.int32), group_size=2, version=0)

    async def join(self, name: str, credits: int, max_concurrency: int = 8):
        ident = name.encode()
        await self.adm.hello(ident, protocol.Hello(server_id=name, engine="e", model="m", version=self.version,
                                                   max_concurrency=max_concurrency))
        srv = self.adm.servers[ident]
        await self.adm.work_request(srv, protocol.WorkRequest(server_id=name, credits=credits))
        return srv

    def evals(self, identity: bytes | None = None) -> list[protocol.Assignment]:
        return [m for i, m in self.sent if isinstance(m, protocol.Assignment) and m.group_size == 1
                and (identity is None or i == identity)]

    async def answer(self, a: protocol.Assignment, reward: float, server: str = "x", **change) -> protocol.Ack:
        s = samples_for(a, version=self.version, reward=lambda i: reward)[0]
        if change:
            fields = {f: getattr(s, f) for f in protocol.Sample.__dataclass_fields__}
            fields.update(change)
            s = protocol.Sample(**fields)
        async def train(msg):
            raise AssertionError("an eval sample reached the training intake")
        return await self.ev.receive(protocol.RolloutResult(server_id=server, samples=[s]), train)


async def test_eval_goes_first_on_credits_and_leaves_the_gate_alone():
    h = Harness(prompts=2)
    assert h.ev.maybe_start(0) and not h.ev.maybe_start(1)          # 1 is not due (every 2)
    capacity = h.buffer.capacity(0)                                 # (0+1+1)·4 = 8
    srv = await h.join("A", credits=5)
    evals = h.evals()
    assert [a.assignment_id for a in evals] == ["run-e1.0", "run-e1.1"]
    assert all(a.sampling.temperature == 1e-6 and a.attempt == 1 for a in evals)
    assert evals[0].metadata == {"answer": "0", "k": 0} and evals[0].prompt_id == "e0"
    # 5 credits: 2 for eval, then one group of 2 (the gate allows 4 groups); 1 credit left over.
    train = [m for _, m in h.sent if isinstance(m, protocol.Assignment) and m.group_size == 2]
    assert len(train) == 1 and srv.credits == 1
    assert h.buffer.capacity(0) == capacity - 2 and h.buffer.counters["issued"] == 2   # eval: none
    assert h.adm.outstanding(srv) == 2 + 2
    ack = await h.answer(evals[0], 1.0)
    assert ack.statuses == ["accepted"] and h.rows == []
    assert (await h.answer(evals[0], 1.0)).statuses == ["duplicate"]
    assert (await h.answer(evals[1], 0.0, prompt_token_ids=np.array([1, 9], np.int32))).statuses == ["invalid"]
    assert h.rows == []                                               # still open
    assert (await h.answer(evals[1], 0.0)).statuses == ["accepted"]
    (row,) = h.rows
    assert row["eval_version"] == 0 and row["eval_samples"] == 2
    assert row["eval_reward_mean"] == 0.5 and row["eval_accuracy"] == 0.5
    assert (await h.answer(evals[1], 0.0)).statuses == ["duplicate"]  # a closed round still knows it
    assert h.adm.outstanding(srv) == 2


async def test_expired_eval_leases_are_reissued_then_dropped_and_rounds_do_not_overlap():
    h = Harness(prompts=1, lease_timeout_s=10.0)
    h.ev.maybe_start(0)
    await h.join("A", credits=1)                                      # room for the eval only
    await h.join("B", credits=1)
    for attempt in (1, 2, 3):
        (a,) = h.evals()[-1:]
        assert a.attempt == attempt
        h.now += 11.0                                                 # past the eval lease
        for srv in list(h.adm.servers.values()):                      # both still alive
            srv.last_seen = h.now
            srv.credits = 1
        await h.adm.tick()
    assert len(h.evals()) == 3                                        # 3 attempts, then given up
    (row,) = h.rows
    assert row["eval_dropped"] == 1 and row["eval_samples"] == 0 and np.isnan(row["eval_reward_mean"])
    assert [e for e, _ in h.log if e == "eval_dropped"] == ["eval_dropped"]
    # A round due while one is open is skipped and counted.
    h.version = 2
    assert h.ev.maybe_start(2)
    h.version = 4
    assert not h.ev.maybe_start(4)
    assert h.metrics.value("slipstream_eval_rounds_total", {"outcome": "skipped"}) == 1


async def test_lost_server_and_refusal_reissue_at_once():
    h = Harness(prompts=1)
    h.ev.maybe_start(0)
    a_srv = await h.join("A", credits=1)
    (first,) = h.evals(b"A")
    await h.join("B", credits=1)
    h.adm.lose(a_srv, "unreachable")
    await h.adm.dispatch()
    (second,) = h.evals(b"B")
    assert second.assignment_id == first.assignment_id and second.attempt == 2
    await h.adm.refused(h.adm.servers[b"B"], second.assignment_id, "prompt too long")
    c = await h.join("C", credits=1)
    (third,) = h.evals(b"C")
    assert third.attempt == 3 and h.adm.outstanding(c) == 1
    assert (await h.answer(third, 1.0)).statuses == ["accepted"] and h.rows[0]["eval_accuracy"] == 1.0


async def test_eval_samples_on_weights_a_server_lied_about_are_refused_and_reissued():
    """issue 28.4 for evaluation: a server that applied version 2 with a wrong checksum scores
    nothing: its eval sample with a token of version 2 is refused (invalid) and the assignment
    goes to another server, whose answer completes the round."""
    h = Harness(prompts=1)
    h.version = 2
    await h.adm.announce(protocol.WeightsAvailable(version=2, kind="full", tensors=[], total_bytes=0,
                                                   chunk_bytes=1024, num_chunks=0, checksum="published"))
    assert h.ev.maybe_start(2)
    liar = await h.join("A", credits=1)
    (first,) = h.evals(b"A")
    assert not await h.adm.weights_applied(liar, protocol.WeightsApplied(server_id="A", version=2,
                                                                          checksum="other", seconds=0.1))
    assert (await h.answer(first, 1.0, server="A")).statuses == ["invalid"]
    assert ("eval_sample_invalid", {"sample_id": protocol.sample_id(first.assignment_id, 0), "server": "A",
                                    "reason": "unverified_weights"}) in h.log
    assert not h.rows                                                 # the round is still open
    await h.join("B", credits=1)
    (second,) = h.evals(b"B")
    assert second.assignment_id == first.assignment_id and second.attempt == 2
    assert (await h.answer(second, 1.0, server="B")).statuses == ["accepted"]
    assert h.rows[0]["eval_accuracy"] == 1.0 and h.rows[0]["eval_samples"] == 1


def test_from_config_takes_the_same_prompts_every_round_and_needs_a_count_for_a_task(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text("\n".join(f'{{"prompt": "{i}+0=", "answer": "{i}"}}' for i in range(5)))
    tok = build_tokenizer()
    cfg = LearnerConfig(**nested(eval_data=str(data), eval_every=3, eval_prompts=3))

    def evaluation(**changes) -> Evaluation:
        return Evaluation.from_config(cfg.evaluation.model_copy(update=changes), cfg.data, seed=cfg.seed,
                                      max_new_tokens=4, lease_timeout_s=60.0, tokenizer=tok, encode=None,
                                      run_id="r", version=lambda: 0, metrics=LearnerMetrics(),
                                      record=lambda row: None)
    ev = evaluation()
    assert [p["prompt_id"] for p in ev.prompts] == ["e0", "e1", "e2"] and ev.prefix == "r-e"
    assert all(p["prompt_token_ids"][0] == tok.bos_token_id for p in ev.prompts)
    assert ev.sampling.max_new_tokens == 4 and ev.lease_timeout_s == 60.0
    everything = evaluation(prompts=0)
    assert sorted(p["prompt"] for p in everything.prompts) == [f"{i}+0=" for i in range(5)]
    more = evaluation(prompts=50)
    assert len(more.prompts) == 5                                     # each row once, not repeated
    with pytest.raises(protocol.StartupError, match="endless built-in task; set evaluation.prompts"):
        evaluation(data="builtin:arith", prompts=0)
