"""vLLM worker extension: in-place full-weight reload inside vLLM's worker process.

Loaded by vLLM through ``worker_extension_cls="rollout_server.vllm_worker.SlipstreamWorkerExtension"``;
its methods become callable with ``AsyncLLM.collective_rpc(name, args=...)`` and run on every
worker (``self`` is the worker: ``self.model_runner`` is its model runner).

Transport: vLLM's utility-call serializer (msgpack) does not rebuild ``torch.Tensor`` arguments of
``collective_rpc`` (untyped args arrive as ``(dtype, shape, buffer-index)`` tuples), so the engine
writes the new weights to one safetensors file (in ``/dev/shm`` when it exists) and passes its path;
every worker memory-maps it and streams ``(name, tensor)`` pairs into
``model_runner.reload_weights(weights_iterator=..., is_checkpoint_format=True)`` — vLLM's in-place
layerwise reload, which takes checkpoint-format (HF) names and handles the CPU backend's repacked
linear weights (a direct ``model.load_weights`` fails there).
"""

from __future__ import annotations

import time


class SlipstreamWorkerExtension:
    """Mixed into vLLM's worker class; no state of its own."""

    def slipstream_reload_weights(self, path: str) -> dict:
        """Reload every tensor of the safetensors file at ``path``; returns names count and seconds."""
        from safetensors import safe_open

        start = time.monotonic()
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())

            def weights():
                for name in names:
                    yield name, f.get_tensor(name)

            self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        self._slipstream_refresh_tied_head(names)
        return {"tensors": len(names), "seconds": time.monotonic() - start}

    def _slipstream_refresh_tied_head(self, names: list[str]) -> None:
        """Re-derive a tied LM head's kernel state from the (reloaded) embedding.

        With ``tie_word_embeddings`` the checkpoint has no ``lm_head.weight``; the layerwise reload
        then skips the head ("ParallelLMHead: Failed to load weights") and, on the CPU backend, its
        GEMM closure (``cpu_linear``: a packed copy / oneDNN handle of the weight) keeps the *old*
        embedding although the shared parameter was updated. Re-running the head's
        ``process_weights_after_loading`` repacks it from the new weight (verified: without this the
        log-probs after a full update do not match an HF recompute).
        """
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        head = getattr(head, "base_layer", head)
        if head is None or "lm_head.weight" in names:
            return
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
