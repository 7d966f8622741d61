"""The reference policy: the initial policy, frozen, for the KL term (docs/design.md §4, §5).

KL(π_θ ‖ π_ref) keeps the trained policy near where it started. Its log-probs use the sampling
temperature, as the policy's do, so both are log-probs of the same kind of distribution; they go
through :class:`learner.models.forward.LogprobForward` (no ``[B, T, V]`` logits).

Two kinds:

* Full fine-tuning (:meth:`ReferencePolicy.copy_of`): the policy as it was loaded, deep-copied
  before the first update, with no gradients and in eval mode, optionally on the CPU while the
  policy is on an accelerator (the pass then moves its inputs there and its log-probs back).
  ``state_dict`` holds the initial weights; a resumed run must load them (not copy the resumed
  policy, which is no longer the initial one).
* LoRA (:meth:`ReferencePolicy.adapter_disabled`): the policy's own base model with the adapter
  switched off for the pass (PEFT ``disable_adapter``). The base weights are frozen, so this *is*
  the initial policy, with no second copy in memory (``reference_on_cpu`` has nothing to move);
  its ``state_dict`` is empty.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from learner.models.forward import LogprobForward

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    def __init__(self, model: torch.nn.Module, owns_weights: bool, autocast: torch.dtype | None = None):
        self.model = model
        self.owns_weights = owns_weights
        self.forward = LogprobForward(model, autocast=autocast)
        self.device = next(model.parameters()).device

    @classmethod
    def copy_of(cls, policy: torch.nn.Module, device: torch.device | str | None = None,
                autocast: torch.dtype | None = None) -> ReferencePolicy:
        """A frozen deep copy of ``policy`` (on ``device`` when given); ``autocast``: the
        policy's mixed precision (learner.models.forward)."""
        model = copy.deepcopy(policy)
        if device is not None:
            model.to(device)
        model.eval()
        model.requires_grad_(False)
        return cls(model, owns_weights=True, autocast=autocast)

    @classmethod
    def adapter_disabled(cls, peft_model: torch.nn.Module,
                         autocast: torch.dtype | None = None) -> ReferencePolicy:
        """The base of a PEFT-wrapped policy (shares its weights; the adapter off in each pass)."""
        return cls(peft_model, owns_weights=False, autocast=autocast)

    @contextlib.contextmanager
    def _as_reference(self):
        if self.owns_weights:
            yield
            return
        training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                yield
        finally:
            self.model.train(training)

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                 temperature: float | torch.Tensor) -> torch.Tensor:
        """log π_ref of ``targets`` (b, L-1) given right-padded ``input_ids`` (b, L), on the inputs' device."""
        out_device = input_ids.device
        with self._as_reference():
            lp, _ = self.forward(input_ids.to(self.device), attention_mask.to(self.device),
                                 targets.to(self.device), temperature)
        return lp.to(out_device)                                                   # (b, L-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict() if self.owns_weights else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.owns_weights:
            self.model.load_state_dict(state)
