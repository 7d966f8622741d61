"""Prompt sources: a built-in task (:mod:`learner.tasks`) or a JSONL file.

Every prompt is a dict ``{"prompt_id": str, "prompt": str, "answer": str, "metadata": dict}``; the
answer and the metadata travel to the rollout server in the assignment's metadata, where the
reward function reads them. A JSONL line is one object with ``prompt`` and ``answer``; every other
key of the line goes into ``metadata`` unchanged.

Every problem with the dataset (no such file, a line that is not JSON, a missing key, no rows)
is a one-line :class:`protocol.StartupError` naming the file and line, raised when the source is
opened: before the model loads, so ``slipstream`` can check the dataset before starting anything.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from learner.tasks import get_task, is_builtin
from protocol.errors import StartupError

WHAT = "learner.dataset"


def read_jsonl(spec: str) -> list[dict]:
    """The rows of a JSONL dataset as ``{"prompt", "answer", "metadata"}`` dicts (checked)."""
    path = Path(spec)
    if not path.is_file():
        raise StartupError(f"{WHAT}: {spec!r}: no such file (give a JSONL file with one "
                           f'{{"prompt": ..., "answer": ...}} per line, or builtin:arith)')
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise StartupError(f"{WHAT}: {spec}:{n}: not JSON: {getattr(e, 'msg', e)} "
                                       f"(column {getattr(e, 'colno', '?')})") from None
                if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
                    raise StartupError(f"{WHAT}: {spec}:{n}: each line needs an object with "
                                       f"'prompt' and 'answer'")
                metadata = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
                rows.append({"prompt": str(row["prompt"]), "answer": str(row["answer"]),
                             "metadata": metadata})
    except UnicodeDecodeError as e:
        raise StartupError(f"{WHAT}: {spec}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise StartupError(f"{WHAT}: cannot read {spec}: {e.strerror}") from None
    if not rows:
        raise StartupError(f"{WHAT}: {spec} has no rows")
    return rows


class PromptSource:
    """An endless, seeded stream of prompts with a position that can be saved and restored.

    Prompt ``i`` depends only on (spec, seed, i): a built-in task draws it with
    ``Random(seed * 1_000_003 + i)``; a file is shuffled per epoch with ``Random(seed * 7919 + epoch)``.
    """

    def __init__(self, spec: str, seed: int = 0):
        self.spec = spec
        self.seed = seed
        self.position = 0
        self._epoch, self._epoch_order = -1, []
        if is_builtin(spec):
            self.task = get_task(spec)
            self._rows = None
        else:
            self.task = None
            self._rows = read_jsonl(spec)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        i = self.position
        self.position += 1
        if self._rows is None:
            ex = self.task.example(random.Random(self.seed * 1_000_003 + i))
            row = {"prompt": ex.prompt, "answer": ex.answer, "metadata": dict(ex.metadata)}
        else:
            epoch, j = divmod(i, len(self._rows))
            row = self._rows[self._order(epoch)[j]]
            row = {**row, "metadata": dict(row["metadata"])}
        return {"prompt_id": f"p{i}", **row}

    def _order(self, epoch: int) -> list[int]:
        """The shuffled row order of ``epoch`` (kept for the current epoch: one shuffle per epoch)."""
        if self._epoch != epoch:
            self._epoch_order = list(range(len(self._rows)))
            random.Random(self.seed * 7919 + epoch).shuffle(self._epoch_order)
            self._epoch = epoch
        return self._epoch_order

    def state_dict(self) -> dict:
        return {"spec": self.spec, "seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
