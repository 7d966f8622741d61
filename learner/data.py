"""Prompt sources: the built-in arithmetic task and JSONL files.

Every prompt is a dict ``{"prompt_id": str, "prompt": str, "answer": str}``; the answer travels to
the rollout server in the assignment's metadata, where the reward function checks it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

ARITH_MAX_OPERAND = 9


def arith_example(rng: random.Random) -> tuple[str, str]:
    """One "a+b=" problem with a, b in [0, ARITH_MAX_OPERAND]; the answer is the decimal sum."""
    a, b = rng.randint(0, ARITH_MAX_OPERAND), rng.randint(0, ARITH_MAX_OPERAND)
    return f"{a}+{b}=", str(a + b)


class PromptSource:
    """An endless, seeded stream of prompts with a position that can be saved and restored."""

    def __init__(self, spec: str, seed: int = 0):
        self.spec = spec
        self.seed = seed
        self.position = 0
        if spec == "builtin:arith":
            self._rows = None
        else:
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"dataset {spec!r}: no such file (use builtin:arith or a JSONL path)")
            self._rows = []
            for i, line in enumerate(path.read_text().splitlines()):
                if not line.strip():
                    continue
                row = json.loads(line)
                if "prompt" not in row or "answer" not in row:
                    raise ValueError(f"{spec}:{i + 1}: each line needs 'prompt' and 'answer'")
                self._rows.append({"prompt": str(row["prompt"]), "answer": str(row["answer"])})
            if not self._rows:
                raise ValueError(f"dataset {spec!r} is empty")

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        i = self.position
        self.position += 1
        if self._rows is None:
            prompt, answer = arith_example(random.Random(self.seed * 1_000_003 + i))
        else:
            epoch, j = divmod(i, len(self._rows))
            order = list(range(len(self._rows)))
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            row = self._rows[order[j]]
            prompt, answer = row["prompt"], row["answer"]
        return {"prompt_id": f"p{i}", "prompt": prompt, "answer": answer}

    def state_dict(self) -> dict:
        return {"spec": self.spec, "seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
