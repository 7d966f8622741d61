"""A calculator tool (``builtin:calc``): ``c<a><op><b>.`` is a call, answered with `` <value>=``;
a turn that is a number is the answer (reward ``correct`` 1 when it is the row's ``answer``).

The tool parses the call from the model's text (the engine knows nothing of it); a call it
cannot parse is a tool error (answered `` error=``, counted in ``tool_errors``). Operators: + - *.
"""

from __future__ import annotations

import re
from typing import Any

_CALL = re.compile(r"^\s*c(\d{1,6})([*+-])(\d{1,6})\.?\s*$")
_NUMBER = re.compile(r"-?\d+")


class Calculator:
    async def reset(self, prompt: str, metadata: dict[str, Any]) -> str | None:
        self.answer = str(metadata.get("answer", "")).strip()
        return None

    async def step(self, completion: str, state: Any) -> tuple[str | None, dict[str, float], bool, dict]:
        text = completion.strip()
        if text.startswith("c"):
            m = _CALL.match(text)
            if m is None:
                return " error=", {"correct": 0.0}, False, {"tool_calls": 1, "tool_errors": 1}
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            value = a * b if op == "*" else a + b if op == "+" else a - b
            return f" {value}=", {"correct": 0.0}, False, {"tool_calls": 1}
        m = _NUMBER.search(text)
        correct = float(m is not None and m.group() == self.answer)
        return None, {"correct": correct}, True, {}
