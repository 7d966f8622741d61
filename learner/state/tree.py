"""Nested state (dicts, lists, numbers, tensors) to JSON plus one tensor file and back, and the RNG
states a checkpoint saves (:mod:`learner.state.checkpoint` writes them; the DeepSpeed ranks use
them for their own shards)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

_TENSOR, _DICT, _TUPLE = "__tensor__", "__dict__", "__tuple__"



def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "",
                _ptrs: set[int] | None = None, copy: bool = False) -> Any:
    """A nested state (dicts with str/int keys, lists, tuples, numbers, tensors) as JSON data; its
    tensors go into ``tensors`` under their path. Tensors sharing memory are stored once each
    (safetensors refuses shared storage), as contiguous CPU copies where they are not already
    (``copy``: always a copy, so the live tensors may change while it is written)."""
    if _ptrs is None:                     # storages already in ``tensors`` (the RNG states, say)
        _ptrs = {u.data_ptr() for u in tensors.values() if u.numel()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        copied = t.device.type != "cpu"
        if copied:
            t = t.cpu()                   # a new host tensor
        if not t.is_contiguous():
            t, copied = t.contiguous(), True
        if (copy and not copied) or (t.numel() and t.data_ptr() in _ptrs):
            t = t.clone()
        if t.numel():
            _ptrs.add(t.data_ptr())
        tensors[path] = t
        return {_TENSOR: path}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"checkpoint state: key {k!r} at {path or '/'} is not a str or int")
            items.append([k, encode_tree(v, tensors, f"{path}/{k}", _ptrs, copy)])
        return {_DICT: items}
    if isinstance(obj, tuple):
        return {_TUPLE: [encode_tree(v, tensors, f"{path}/{i}", _ptrs, copy) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode_tree(v, tensors, f"{path}/{i}", _ptrs, copy) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state: {type(obj).__name__} at {path or '/'} cannot be saved")


def decode_tree(node: Any, tensors: dict[str, torch.Tensor], used: set[str] | None = None) -> Any:
    """Inverse of :func:`encode_tree`; ``ValueError`` on anything it would not have written."""
    if isinstance(node, dict):
        if set(node) == {_TENSOR}:
            key = node[_TENSOR]
            if not isinstance(key, str) or key not in tensors:
                raise ValueError(f"tensor {key!r} is not in the tensor file")
            if used is not None:
                used.add(key)
            return tensors[key]
        if set(node) == {_DICT} and isinstance(node[_DICT], list):
            out = {}
            for item in node[_DICT]:
                if (not isinstance(item, list) or len(item) != 2
                        or not isinstance(item[0], (str, int)) or isinstance(item[0], bool)):
                    raise ValueError("a dict entry is not a [key, value] pair")
                out[item[0]] = decode_tree(item[1], tensors, used)
            return out
        if set(node) == {_TUPLE} and isinstance(node[_TUPLE], list):
            return tuple(decode_tree(v, tensors, used) for v in node[_TUPLE])
        raise ValueError(f"unexpected object with keys {sorted(node)[:5]}")
    if isinstance(node, list):
        return [decode_tree(v, tensors, used) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise ValueError(f"unexpected {type(node).__name__}")


def rng_state(tensors: dict[str, torch.Tensor]) -> dict:
    """Python, numpy and torch (CPU, and every CUDA device when CUDA is initialized) RNG states;
    the torch ones go into ``tensors``."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    tensors["rng/torch"] = torch.get_rng_state()
    cuda = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
            cuda += 1
    return {"python": [version, list(internal), gauss],
            "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
            "cuda_devices": cuda}


def set_rng_state(state: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                         float(cached)))
    torch.set_rng_state(tensors["rng/torch"].to(torch.uint8))
    n = int(state.get("cuda_devices", 0))
    if n and torch.cuda.is_available() and torch.cuda.device_count() >= n:
        for i in range(n):
            torch.cuda.set_rng_state(tensors[f"rng/cuda/{i}"].to(torch.uint8), i)
