"""Prompt sources: a built-in task (:mod:`learner.data.tasks`) or a dataset file, as a seeded stream.

Sources (``learner.data.dataset``; ``learner.evaluation.data`` takes the same):

    builtin:NAME         a built-in task: an endless stream drawn with Random(seed * 1_000_003 + i)
    FILE.jsonl           one JSON object per line (read here: errors name the line)
    FILE.json            a JSON list of objects
    FILE.parquet         a Parquet table (pyarrow, which ``datasets`` brings)
    DIR                  a directory written by ``datasets``' ``save_to_disk`` (a Dataset, or a
                         DatasetDict and ``dataset_split``); read with ``datasets.load_from_disk``,
                         offline (nothing is fetched from the Hub)

Rows. Each row needs ``prompt_key`` (a string, or a list of chat messages ``{"role", "content"}``)
and ``answer_key`` (a string or number; none with ``answer_key: null``, TRL's datasets); every
other field of the row goes unchanged into the prompt's ``metadata``, which travels with the
assignment to the reward function (as plain msgpack values: NumPy scalars and arrays become
numbers and lists), and so do the chat messages of a prompt the template formats
(``protocol.PROMPT_MESSAGES_KEY``: the row's messages, or its string as a user message, with the
system prompt when one is set).
``learner.data.preset`` (trl, verl) sets the two keys for another trainer's layout. A stream
item is::

    {"prompt_id": "p<i>", "prompt": str, "answer": str | None, "metadata": dict,
     "prompt_token_ids": int32 array}          # the last one once a tokenizer is attached

where ``prompt`` is the text the model sees (after the chat template). The learner sends these
token ids as they are: prompts are tokenized once, here.

Chat template (``chat_template``): ``auto`` formats a prompt with the tokenizer's template when the
prompt is a list of messages or ``system_prompt`` is set; ``always`` formats every prompt (a string
becomes one user message); ``never`` sends the text as it is. Formatting is
``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` then ``encode`` without
special tokens (the template writes its own BOS, if it wants one); a plain prompt is encoded the
way the trainer encodes prompts (BOS first). What cannot be done — messages without a template or
under ``never``, ``always`` or a ``system_prompt`` without a template — is a one-line
:class:`StartupError` when the tokenizer is attached (right after the model loads). A row whose
messages begin with a system message keeps it (``system_prompt`` is not added twice).

Skipping. With ``max_prompt_tokens`` > 0, a file row whose prompt is longer is left out once, at
load, and a built-in draw that is longer is passed over; each counts once in
``skipped["too_long"]`` (the learner's ``slipstream_prompts_skipped_total{reason}`` and ``ctl
status``). A file with every row too long is a StartupError.

Order. A file is read in a new seeded order every epoch (``Random(seed * 7919 + epoch)``; with
``shuffle: false`` in file order). With ``length_buckets: B`` the kept rows are sorted by token
length into B buckets of equal size (fixed for the run); every epoch each bucket is shuffled and
cut into batches of ``batch_prompts`` prompts, the remainders of all buckets are sorted by length
and cut the same way, and the batches are shuffled: the prompts of one batch (consecutive
``batch_prompts`` items of the stream) come from one bucket, except at most B - 1 batches of
remainders per epoch, which are still of near lengths.

Epochs. ``epochs: 0`` is endless. ``epochs: N`` ends the stream after N passes over a file,
rounded down to whole batches: a partial last batch is never handed out (so never generated), and
``unused`` says how many prompts that left out. ``exhausted`` turns true when the last one is
drawn; the learner then finishes after the last full batch it can form. Built-in tasks are endless.

Position. ``state_dict()`` is the position (prompts drawn), the skip counts and what the position
means (spec, seed, rows kept); ``load_state_dict`` on a source opened the same way continues with
exactly the prompts the saved one would have given next, because prompt ``i`` depends only on
(spec, seed, i) and the config. A state for another dataset is refused in one line.

Every problem with the dataset (no such file, a line that is not JSON, a missing key, a prompt that
is neither text nor messages, no rows) is a one-line :class:`protocol.StartupError` naming the file
and row, raised when the source is opened: before the model loads (:func:`check_dataset`), so
``slipstream`` can check the dataset before starting anything.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from learner.config import DataSettings
from learner.data.tasks import get_task, is_builtin
from protocol.errors import ProtocolError, StartupError
from protocol.messages import DATASET_KEY, PROMPT_MESSAGES_KEY
from protocol.schema import check_plain

WHAT = "learner.data.dataset"
FORMATS = ".jsonl, .json, .parquet or a datasets save_to_disk directory"
MAX_BUILTIN_SKIPS = 10_000
"""Consecutive built-in draws over max_prompt_tokens before the stream gives up."""
BUILTIN_EDGE_DRAWS = 512
"""Draws (a seed of their own) whose token lengths set a built-in task's length-bucket edges."""
RENDER_CACHE = 4096
"""Formatted built-in prompts remembered by their text (PromptSource._render)."""


# ---- reading rows --------------------------------------------------------------------------------

def _plain(value: Any, where: str) -> Any:
    """``value`` as plain msgpack data (what assignment metadata may hold)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return [_plain(v, where) for v in value]
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return value


def _messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in value))


_MISSING = object()


def _lookup(record: dict, key: str) -> Any:
    """``record[key]``, or, for a dotted ``key`` that is not a column itself, the nested field it
    names (``reward_model.ground_truth``: verl's RL parquet keeps the answer there); ``_MISSING``
    when there is none."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split(".") if "." in key else ():
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value if "." in key else _MISSING


def make_row(record: Any, where: str, prompt_key: str = "prompt", answer_key: str | None = "answer",
             what: str = WHAT) -> dict:
    """One checked row ``{"prompt": str | messages, "answer": str | None, "metadata": dict}``. A
    key may be a dotted path into a nested column (:func:`_lookup`); the metadata is every column
    but the two named at the top level (a nested one stays whole: the reward may want its other
    fields), and a prompt of chat messages also as they are (``protocol.PROMPT_MESSAGES_KEY``:
    TRL's conversational rewards take them). ``answer_key`` None: no answer (None)."""
    prompt = _lookup(record, prompt_key) if isinstance(record, dict) else _MISSING
    answer = (None if answer_key is None else _lookup(record, answer_key)) if isinstance(record, dict) else _MISSING
    if prompt is _MISSING or answer is _MISSING:
        needs = repr(prompt_key) if answer_key is None else f"{prompt_key!r} and {answer_key!r}"
        raise StartupError(f"{what}: {where}: each row needs an object with {needs} "
                           f"(learner.data.prompt_key / learner.data.answer_key name them; "
                           "a dotted name reaches into a nested column)")
    if isinstance(prompt, (list, tuple)) or (isinstance(prompt, np.ndarray) and prompt.dtype == object):
        prompt = [_plain(m, where) for m in prompt]
        if not _messages(prompt):
            raise StartupError(f"{what}: {where}: {prompt_key!r} is a list but not chat messages "
                               f"(each a {{'role': str, 'content': str}})")
    elif not isinstance(prompt, str):
        raise StartupError(f"{what}: {where}: {prompt_key!r} must be a string or a list of chat "
                           f"messages, got {type(prompt).__name__}")
    answer = _plain(answer, where)
    if answer_key is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise StartupError(f"{what}: {where}: {answer_key!r} must be a string or a number, got "
                           f"{type(answer).__name__}")
    metadata = {str(k): _plain(v, where) for k, v in record.items() if k not in (prompt_key, answer_key)}
    if isinstance(prompt, list):
        metadata[PROMPT_MESSAGES_KEY] = prompt
    try:
        check_plain(metadata, "metadata")
    except ProtocolError as e:
        raise StartupError(f"{what}: {where}: {e} (metadata must be plain data)") from None
    return {"prompt": prompt, "answer": None if answer is None else str(answer), "metadata": metadata}


def read_jsonl(spec: str, prompt_key: str = "prompt", answer_key: str | None = "answer",
               what: str = WHAT) -> list[dict]:
    """The rows of a JSONL dataset (checked: a bad line names its number)."""
    path = Path(spec)
    if not path.is_file():
        raise StartupError(f"{what}: {spec!r}: no such file (give a JSONL file with one "
                           f'{{"prompt": ..., "answer": ...}} per line, or builtin:arith)')
    rows = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise StartupError(f"{what}: {spec}:{n}: not JSON: {getattr(e, 'msg', e)} "
                                       f"(column {getattr(e, 'colno', '?')})") from None
                rows.append(make_row(record, f"{spec}:{n}", prompt_key, answer_key, what))
    except UnicodeDecodeError as e:
        raise StartupError(f"{what}: {spec}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise StartupError(f"{what}: cannot read {spec}: {e.strerror}") from None
    return rows


def _read_json(path: Path, what: str) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise StartupError(f"{what}: {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise StartupError(f"{what}: {path}:{getattr(e, 'lineno', '?')}: not JSON: "
                           f"{getattr(e, 'msg', e)} (column {getattr(e, 'colno', '?')})") from None
    except OSError as e:
        raise StartupError(f"{what}: cannot read {path}: {e.strerror}") from None
    if not isinstance(data, list):
        raise StartupError(f"{what}: {path}: a .json dataset is a list of rows, got a "
                           f"{type(data).__name__} (one object per line is .jsonl)")
    return data


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def _read_parquet(path: Path, what: str) -> list:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad dataset, said in one line
        raise StartupError(f"{what}: {path}: not a readable Parquet file: {_first_line(e)}") from None


def _read_saved(path: Path, split: str, what: str) -> list:
    """A ``save_to_disk`` directory: a Dataset, or the ``split`` of a DatasetDict."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")      # nothing here needs the Hub
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - as above
        raise StartupError(f"{what}: {path}: not a datasets save_to_disk directory ({FORMATS}): "
                           f"{_first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise StartupError(f"{what}: {path} has no split {split!r} (learner.data.dataset_split); "
                               f"splits: {', '.join(ds)}")
        ds = ds[split]
    return ds.to_list()


def read_rows(spec: str, *, split: str = "train", prompt_key: str = "prompt",
              answer_key: str | None = "answer", what: str = WHAT) -> list[dict]:
    """The checked rows of a dataset file or directory (see the module docstring)."""
    path = Path(spec)
    if not path.exists():
        raise StartupError(f"{what}: {spec!r}: no such file or directory (give a {FORMATS}, or "
                           "builtin:arith; nothing is downloaded from the Hub)")
    if path.is_dir():
        records, where = _read_saved(path, split, what), f"{spec}: row {{}}"
    elif path.suffix == ".jsonl":
        rows = read_jsonl(spec, prompt_key, answer_key, what)
        records = None
    elif path.suffix == ".json":
        records, where = _read_json(path, what), f"{spec}: row {{}}"
    elif path.suffix == ".parquet":
        records, where = _read_parquet(path, what), f"{spec}: row {{}}"
    else:
        raise StartupError(f"{what}: {spec}: unknown format {path.suffix or '(no suffix)'!r} "
                           f"(give a {FORMATS})")
    if records is not None:
        rows = [make_row(r, where.format(i), prompt_key, answer_key, what) for i, r in enumerate(records)]
    if not rows:
        raise StartupError(f"{what}: {spec} has no rows")
    return rows


# ---- chat template and tokens --------------------------------------------------------------------

def default_encode(tokenizer) -> Callable[[str], np.ndarray]:
    """Plain text -> ids the way the trainer encodes prompts: no special tokens, then BOS first."""
    bos = tokenizer.bos_token_id

    def encode(text: str) -> np.ndarray:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return np.asarray(ids, dtype=np.int32)
    return encode


class Formatter:
    """Prompt (text or messages) -> (text the model sees, its token ids), per ``chat_template``."""

    def __init__(self, tokenizer, *, chat_template: str = "auto", system_prompt: str | None = None,
                 encode: Callable[[str], np.ndarray] | None = None, what: str = WHAT):
        self.tokenizer, self.mode, self.system_prompt = tokenizer, chat_template, system_prompt
        self.encode = encode or default_encode(tokenizer)
        self.what = what
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        fix = "give the tokenizer a chat_template, or set learner.data.chat_template: never"
        if chat_template == "always" and not self.has_template:
            raise StartupError(f"learner.data.chat_template: always, but the policy tokenizer has no chat "
                               f"template ({fix})")
        if system_prompt is not None and chat_template == "never":
            raise StartupError("learner.data.system_prompt needs the chat template, but "
                               "learner.data.chat_template is never (unset system_prompt, or use auto)")
        if system_prompt is not None and not self.has_template:
            raise StartupError("learner.data.system_prompt is set, but the policy tokenizer has no chat "
                               "template to put it in (unset system_prompt, or give the tokenizer one)")

    def messages(self, prompt: str | list) -> list | None:
        """The chat messages the template formats ``prompt`` as (the system prompt included);
        None when it is sent as text. An agent program's first request carries these
        (``protocol.PROMPT_MESSAGES_KEY``, rollout_server/agents.py)."""
        messages = isinstance(prompt, list)
        use = self.mode == "always" or (self.mode == "auto" and (messages or self.system_prompt is not None))
        if not use or not self.has_template:
            return None
        msgs = list(prompt) if messages else [{"role": "user", "content": prompt}]
        if self.system_prompt is not None and msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def __call__(self, prompt: str | list, where: str) -> tuple[str, np.ndarray]:
        messages = isinstance(prompt, list)
        use = self.mode == "always" or (self.mode == "auto" and (messages or self.system_prompt is not None))
        if not use:
            if messages:
                why = ("learner.data.chat_template is never" if self.mode == "never"
                       else "the policy tokenizer has no chat template")
                raise StartupError(f"{self.what}: {where}: the prompt is chat messages but {why} "
                                   "(give the tokenizer a chat_template, or plain-text prompts)")
            return prompt, self.encode(prompt)
        if not self.has_template:
            raise StartupError(f"{self.what}: {where}: the prompt is chat messages but the policy "
                               "tokenizer has no chat template (give it one, or plain-text prompts)")
        msgs = self.messages(prompt)
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template that refuses a row is a bad row
            raise StartupError(f"{self.what}: {where}: the chat template refused the prompt: "
                               f"{_first_line(e)}") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text, np.asarray(ids, dtype=np.int32)


# ---- the stream ----------------------------------------------------------------------------------

class PromptSource:
    """A seeded stream of prompts with a position that can be saved and restored (see the module
    docstring). ``PromptSource(spec, seed)`` opens and checks the dataset without a tokenizer;
    :meth:`attach` (or ``tokenizer=``) formats, tokenizes, filters and buckets it."""

    def __init__(self, spec: str, seed: int = 0, *, split: str = "train", prompt_key: str = "prompt",
                 answer_key: str | None = "answer", chat_template: str = "auto",
                 system_prompt: str | None = None, max_prompt_tokens: int = 0, shuffle: bool = True,
                 epochs: int = 0, length_buckets: int = 0, batch_prompts: int = 1,
                 tokenizer=None, encode: Callable[[str], np.ndarray] | None = None,
                 what: str = WHAT, on_skip: Callable[[str, int], None] = lambda reason, n: None):
        self.spec, self.seed, self.what = spec, seed, what
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.max_prompt_tokens, self.shuffle = max_prompt_tokens, shuffle
        self.epochs, self.length_buckets, self.batch_prompts = epochs, length_buckets, max(1, batch_prompts)
        self.on_skip = on_skip
        self.position = 0
        self.skipped: Counter[str] = Counter()
        self.unused = 0                                # prompts of a partial last batch, never drawn
        self._epoch, self._epoch_order = -1, []
        self._format: Formatter | None = None
        self._rendered: dict[str, tuple[str, np.ndarray]] = {}   # built-ins: prompt -> formatted
        self._ids: list[np.ndarray] | None = None      # token ids per row (None: no tokenizer)
        self._texts: list[str] | None = None
        self._kept: list[int] | None = None            # rows within max_prompt_tokens
        self._buckets: list[list[int]] | None = None
        self._bucket_of: dict[int, int] = {}            # row -> its bucket id this epoch
        self._edges: list[int] | None = None            # built-ins: token-length bucket edges
        self._pending: list[list[int]] = []             # built-ins: draws waiting, per bucket
        self._run: list[tuple[int, int]] = []           # built-ins: (draw, bucket) to hand out
        self._draws = 0                                 # built-ins with buckets: draws made
        if is_builtin(spec):
            self.task = get_task(spec)
            self._rows = None
        else:
            self.task = None
            self._rows = read_rows(spec, split=split, prompt_key=prompt_key, answer_key=answer_key,
                                   what=what)
        self._kept = list(range(len(self._rows))) if self._rows is not None else None
        self._set_total()
        if tokenizer is not None:
            self.attach(tokenizer, encode)

    @classmethod
    def from_config(cls, data: DataSettings, *, seed: int, batch_prompts: int = 1,
                    eval_data: str | None = None, tokenizer=None, encode=None,
                    on_skip: Callable[[str, int], None] = lambda reason, n: None) -> PromptSource:
        """The training stream of ``learner.data`` (or, given ``eval_data``, those held-out
        prompts: one pass, no buckets, a seed of their own, formatted the same way)."""
        common = dict(split=data.dataset_split, prompt_key=data.prompt_key, answer_key=data.answer_key,
                      chat_template=data.chat_template, system_prompt=data.system_prompt,
                      max_prompt_tokens=data.max_prompt_tokens, tokenizer=tokenizer, encode=encode,
                      on_skip=on_skip)
        if eval_data is not None:
            return cls(eval_data, seed + 1, shuffle=data.shuffle, epochs=0, what="learner.evaluation.data",
                       **common)
        return cls(data.dataset, seed, shuffle=data.shuffle, epochs=data.epochs,
                   length_buckets=data.length_buckets, batch_prompts=batch_prompts, **common)

    # ---- tokenizer ---------------------------------------------------------------------------
    def attach(self, tokenizer, encode: Callable[[str], np.ndarray] | None = None) -> None:
        """Format and tokenize every row (files) or each draw (built-ins) from now on; apply
        ``max_prompt_tokens`` and ``length_buckets``. StartupError for what cannot be formatted."""
        self._format = Formatter(tokenizer, chat_template=self.chat_template,
                                 system_prompt=self.system_prompt, encode=encode, what=self.what)
        if self._rows is None:
            for i in range(100):         # a task whose every prompt is too long fails now, not later
                if self._draw(i, count=False) is not None:
                    break
            else:
                raise StartupError(f"{self.what}: the first 100 prompts of {self.spec} are all longer "
                                   f"than learner.data.max_prompt_tokens={self.max_prompt_tokens}")
            if self.length_buckets > 1:
                # Edges at the quantiles of a fixed sample of draws (its own seed: the stream's
                # draws stay those of an unbucketed run, only their order changes).
                examples = [self.task.example(random.Random(f"{self.spec} length edges {self.seed} {j}"))
                            for j in range(BUILTIN_EDGE_DRAWS)]
                lengths = sorted(len(self._render(ex.prompt, j)[1]) for j, ex in enumerate(examples))
                cuts = np.quantile(lengths, np.linspace(0, 1, self.length_buckets + 1)[1:-1])
                self._edges = sorted({int(c) for c in cuts})
                self._pending = [[] for _ in range(len(self._edges) + 1)]
            return
        where = self._where
        rendered = [self._format(r["prompt"], where(i)) for i, r in enumerate(self._rows)]
        self._texts = [t for t, _ in rendered]
        self._ids = [ids for _, ids in rendered]
        limit = self.max_prompt_tokens
        self._kept = [i for i, ids in enumerate(self._ids) if not limit or len(ids) <= limit]
        dropped = len(self._rows) - len(self._kept)
        if not self._kept:
            longest = min(len(ids) for ids in self._ids)
            raise StartupError(f"{self.what}: every row of {self.spec} is longer than "
                               f"learner.data.max_prompt_tokens={limit} (the shortest has {longest} tokens)")
        if dropped:
            self._skip("too_long", dropped)
        if self.length_buckets:
            by_length = sorted(self._kept, key=lambda i: (len(self._ids[i]), i))
            parts = np.array_split(np.arange(len(by_length)), min(self.length_buckets, len(by_length)))
            self._buckets = [[by_length[j] for j in part] for part in parts]
        self._epoch, self._epoch_order = -1, []
        self._set_total()

    def _where(self, i: int) -> str:
        return f"{self.spec}: row {i}"

    def _skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] += n
        self.on_skip(reason, n)

    def _set_total(self) -> None:
        if self._rows is None or not self.epochs:
            self.total, self.unused = None, 0
            return
        n = len(self._kept) * self.epochs
        self.total = n // self.batch_prompts * self.batch_prompts
        self.unused = n - self.total
        if self.total == 0:
            raise StartupError(f"{self.what}: {self.spec} gives {n} prompts in {self.epochs} epoch(s), "
                               f"fewer than one batch (learner.batch.batch_prompts={self.batch_prompts})")

    # ---- the stream --------------------------------------------------------------------------
    @property
    def rows(self) -> int | None:
        """Rows the stream draws from (after max_prompt_tokens); None for a built-in task."""
        return None if self._kept is None else len(self._kept)

    @property
    def finite(self) -> bool:
        return self.total is not None

    @property
    def exhausted(self) -> bool:
        """Every prompt of the last epoch was drawn (never true for an endless stream)."""
        return self.total is not None and self.position >= self.total

    @property
    def epoch(self) -> int:
        return 0 if self._kept is None else self.position // len(self._kept)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if self.exhausted:
            raise StopIteration
        if self._rows is None:
            if self._edges is not None:
                return self._next_bucketed()
            for _ in range(MAX_BUILTIN_SKIPS):
                i = self.position
                self.position += 1
                item = self._draw(i)
                if item is not None:
                    return item
            raise RuntimeError(f"{self.spec}: {MAX_BUILTIN_SKIPS} draws in a row longer than "
                               f"max_prompt_tokens={self.max_prompt_tokens}")
        i = self.position
        self.position += 1
        epoch, j = divmod(i, len(self._kept))
        r = self._order(epoch)[j]
        row = self._rows[r]
        item = {"prompt_id": f"p{i}", "prompt": row["prompt"], "answer": row["answer"],
                "metadata": copy.deepcopy(row["metadata"])}
        if self._ids is not None:
            self._add_messages(item, row["prompt"])
            item["prompt"] = self._texts[r]
            item["prompt_token_ids"] = self._ids[r]
        if self._buckets is not None:
            item["bucket"] = self._bucket_of[r]
        return item

    def _next_bucketed(self) -> dict:
        """A built-in task with ``length_buckets``: draws go to the bucket of their token length
        (:attr:`_edges`) and leave in runs of ``batch_prompts`` from one bucket, in the order the
        runs fill up. The draws are the unbucketed stream's; the position is the prompts handed
        out, the draws made and the ones waiting (state_dict)."""
        for _ in range(MAX_BUILTIN_SKIPS * self.batch_prompts * (len(self._pending) + 1)):
            if self._run:
                d, b = self._run.pop(0)
                item = self._draw(d, count=False)
                item["prompt_id"], item["bucket"] = f"p{self.position}", b
                self.position += 1
                return item
            d = self._draws
            self._draws += 1
            item = self._draw(d)
            if item is None:
                continue
            b = int(np.searchsorted(self._edges, len(item["prompt_token_ids"]), side="right"))
            self._pending[b].append(d)
            if len(self._pending[b]) == self.batch_prompts:
                self._run, self._pending[b] = [(x, b) for x in self._pending[b]], []
        raise RuntimeError(f"{self.spec}: no bucket filled a batch in many draws "
                           f"(learner.data.length_buckets={self.length_buckets})")

    def _draw(self, i: int, count: bool = True) -> dict | None:
        """Built-in draw ``i``, formatted; None when it is over max_prompt_tokens (counted)."""
        ex = self.task.example(random.Random(self.seed * 1_000_003 + i))
        item = {"prompt_id": f"p{i}", "prompt": ex.prompt, "answer": ex.answer,
                "metadata": dict(ex.metadata)}
        if self._format is not None:
            self._add_messages(item, ex.prompt)
            item["prompt"], item["prompt_token_ids"] = self._render(ex.prompt, i)
            if self.max_prompt_tokens and len(item["prompt_token_ids"]) > self.max_prompt_tokens:
                if count:
                    self._skip("too_long")
                return None
        return item

    def _add_messages(self, item: dict, prompt: str | list) -> None:
        """A templated prompt's messages into its metadata (what an agent's first request sends)."""
        msgs = self._format.messages(prompt)
        if msgs is not None:
            item["metadata"][PROMPT_MESSAGES_KEY] = msgs

    def _render(self, prompt: str | list, i: int) -> tuple[str, np.ndarray]:
        """``prompt`` formatted and tokenized, remembered by its text (RENDER_CACHE entries, oldest
        out first): a built-in task draws the same prompts again and again (``builtin:arith`` has
        100), and the tokenizer's encode was a third of the learner's cost of issuing an assignment
        (about 40 us of ~120 us). The ids are shared by every assignment of that prompt, so they
        are read-only."""
        if type(prompt) is not str:
            return self._format(prompt, f"{self.spec} draw {i}")
        hit = self._rendered.get(prompt)
        if hit is None:
            text, ids = self._format(prompt, f"{self.spec} draw {i}")
            ids.setflags(write=False)
            if len(self._rendered) >= RENDER_CACHE:
                del self._rendered[next(iter(self._rendered))]
            hit = self._rendered[prompt] = (text, ids)
        return hit

    def _order(self, epoch: int) -> list[int]:
        """The row order of ``epoch`` (kept for the current epoch: one shuffle per epoch)."""
        if self._epoch != epoch:
            rng = random.Random(self.seed * 7919 + epoch)
            if self._buckets is not None:
                self._epoch_order = self._bucketed(rng)
            else:
                self._epoch_order = list(self._kept)
                if self.shuffle:
                    rng.shuffle(self._epoch_order)
            self._epoch = epoch
        return self._epoch_order

    def _bucketed(self, rng: random.Random) -> list[int]:
        """This epoch's order: runs of ``batch_prompts`` rows of one bucket (each row's bucket id
        in :attr:`_bucket_of`; a run of the remainders, of near lengths, is a bucket of its own)."""
        bp, batches, rest = self.batch_prompts, [], []
        for b, bucket in enumerate(self._buckets):
            rows = list(bucket)
            if self.shuffle:
                rng.shuffle(rows)
            full = len(rows) // bp * bp
            batches += [(b, rows[k:k + bp]) for k in range(0, full, bp)]
            rest += rows[full:]
        rest.sort(key=lambda i: (len(self._ids[i]), i))
        nb = len(self._buckets)
        batches += [(nb + k // bp, rest[k:k + bp]) for k in range(0, len(rest), bp)]
        self._bucket_of = {r: b for b, rows in batches for r in rows}
        if self.shuffle:
            rng.shuffle(batches)
        return [i for _, rows in batches for i in rows]

    def take(self, n: int) -> list[dict]:
        """The next ``n`` prompts (fewer if the stream ends first)."""
        out = []
        for item in self:
            out.append(item)
            if len(out) == n:
                break
        return out

    # ---- status and checkpoints --------------------------------------------------------------
    def status(self) -> dict:
        return {"dataset": self.spec, "position": self.position, "epoch": self.epoch,
                "rows": self.rows, "total": self.total, "exhausted": self.exhausted,
                "skipped": dict(self.skipped), "unused": self.unused}

    def state_dict(self) -> dict:
        out = {"spec": self.spec, "seed": self.seed, "position": self.position, "rows": self.rows,
               "skipped": dict(self.skipped)}
        if self._edges is not None:        # a bucketed built-in: the draws and who waits where
            out["buckets"] = {"edges": list(self._edges), "draws": self._draws,
                              "pending": [list(p) for p in self._pending], "run": [list(x) for x in self._run]}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was (see the module docstring); refuses another dataset's."""
        for key, mine in (("spec", self.spec), ("seed", self.seed), ("rows", self.rows)):
            if key in state and state[key] != mine:
                raise StartupError(f"{self.what}: the saved prompt position is for {key} "
                                   f"{state[key]!r}, this run has {mine!r} (resume with the same "
                                   "dataset and seed, or start a new run)")
        self.position = int(state["position"])
        self.skipped = Counter({str(k): int(v) for k, v in state.get("skipped", {}).items()})
        saved = state.get("buckets")
        if self._edges is not None and saved is not None and saved["edges"] == self._edges:
            self._draws = int(saved["draws"])
            self._pending = [[int(d) for d in p] for p in saved["pending"]]
            self._run = [(int(d), int(b)) for d, b in saved["run"]]
        elif self._edges is not None:      # an older position: go on from its draws, unbucketed so far
            self._draws = self.position


# ---- a mixture ------------------------------------------------------------------------------------



class MixedSource:
    """``learner.data.datasets``: prompt ``i`` comes from dataset ``k`` drawn with probability
    weight_k / Σ weight by ``Random(seed * 104_729 + i)`` — so the sequence of datasets depends only
    on (seed, i) — and is that dataset's next prompt. Each dataset is an endless
    :class:`PromptSource` with a seed of its own (``seed + 1 + k``; a file reshuffled every pass).
    A prompt keeps its dataset's fields and gets ``prompt_id`` ``p<i>`` and
    ``metadata["slipstream_dataset"]`` = the dataset's name. The position (prompts drawn, and each
    dataset's) is the checkpoint's; a state for another mixture is refused in one line."""

    finite = False
    exhausted = False
    total = None
    unused = 0

    def __init__(self, entries: list, seed: int, sources: list[PromptSource]):
        self.names = [e.label for e in entries]
        self.weights = [float(e.weight) for e in entries]
        self.seed, self.sources = seed, sources
        self.position = 0
        self.drawn = Counter()                         # name -> prompts drawn from it
        self._cum = list(np.cumsum(self.weights))

    @classmethod
    def from_config(cls, data: DataSettings, *, seed: int, tokenizer=None, encode=None,
                    on_skip: Callable[[str, int], None] = lambda reason, n: None) -> MixedSource:
        sources = []
        for k, e in enumerate(data.datasets):
            sources.append(PromptSource(
                e.path, seed + 1 + k, split=e.split or data.dataset_split, prompt_key=e.prompt_key or data.prompt_key,
                answer_key=e.answer_key or data.answer_key, chat_template=data.chat_template,
                system_prompt=data.system_prompt, max_prompt_tokens=data.max_prompt_tokens,
                shuffle=data.shuffle, epochs=0, tokenizer=tokenizer, encode=encode, on_skip=on_skip,
                what=f"{WHAT}s[{k}] ({e.label})"))
        return cls(data.datasets, seed, sources)

    def attach(self, tokenizer, encode: Callable[[str], np.ndarray] | None = None) -> None:
        for source in self.sources:
            source.attach(tokenizer, encode)

    def pick(self, i: int) -> int:
        """The dataset of prompt ``i`` (its index)."""
        x = random.Random(self.seed * 104_729 + i).random() * self._cum[-1]
        return min(int(np.searchsorted(self._cum, x, side="right")), len(self._cum) - 1)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        i = self.position
        k = self.pick(i)
        item = next(self.sources[k])
        self.position += 1
        self.drawn[self.names[k]] += 1
        item["prompt_id"] = f"p{i}"
        item["metadata"] = {**item["metadata"], DATASET_KEY: self.names[k]}
        return item

    def take(self, n: int) -> list[dict]:
        return [next(self) for _ in range(n)]

    @property
    def skipped(self) -> Counter:
        out: Counter[str] = Counter()
        for source in self.sources:
            out.update(source.skipped)
        return out

    @property
    def rows(self) -> None:
        return None

    @property
    def epoch(self) -> int:
        return 0

    def status(self) -> dict:
        return {"datasets": {n: {"weight": w, "drawn": self.drawn[n], **s.status()}
                             for n, w, s in zip(self.names, self.weights, self.sources, strict=True)},
                "position": self.position, "exhausted": False, "skipped": dict(self.skipped)}

    def state_dict(self) -> dict:
        return {"mixture": list(self.names), "weights": list(self.weights), "seed": self.seed,
                "position": self.position, "drawn": dict(self.drawn),
                "sources": [s.state_dict() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was; refuses a state of another mixture (or of one dataset)."""
        mine = {"mixture": self.names, "weights": self.weights, "seed": self.seed}
        for key, value in mine.items():
            if state.get(key) != value:
                raise StartupError(f"{WHAT}s: the saved prompt position is for {key} {state.get(key)!r}, "
                                   f"this run has {value!r} (resume with the same mixture and seed, or start "
                                   "a new run)")
        for source, saved in zip(self.sources, state["sources"], strict=True):
            source.load_state_dict(saved)
        self.position = int(state["position"])
        self.drawn = Counter({str(k): int(v) for k, v in state.get("drawn", {}).items()})


def open_prompts(data: DataSettings, *, seed: int, batch_prompts: int = 1, tokenizer=None, encode=None,
                 on_skip: Callable[[str, int], None] = lambda reason, n: None) -> PromptSource | MixedSource:
    """The training stream of ``learner.data``: one dataset, or a mixture of ``datasets``."""
    if data.datasets:
        return MixedSource.from_config(data, seed=seed, tokenizer=tokenizer, encode=encode, on_skip=on_skip)
    return PromptSource.from_config(data, seed=seed, batch_prompts=batch_prompts, tokenizer=tokenizer,
                                    encode=encode, on_skip=on_skip)


def check_dataset(data: DataSettings, eval_data: str | None, *, seed: int, batch_prompts: int) -> None:
    """Open (and so check) the training dataset (or every dataset of a mixture) and the held-out
    ``eval_data``, without a tokenizer: what ``slipstream`` runs before it starts anything."""
    open_prompts(data, seed=seed, batch_prompts=batch_prompts)
    if eval_data is not None:
        PromptSource.from_config(data, seed=seed, eval_data=eval_data)
