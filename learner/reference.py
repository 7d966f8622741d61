"""The reference policy: a frozen copy of the initial policy, for the KL term (DESIGN.md §4, §5).

KL(π_θ ‖ π_ref) keeps the trained policy near where it started. The reference is the policy as it
was loaded, deep-copied before the first update, with no gradients and in eval mode, optionally on
the CPU while the policy is on an accelerator (the pass then moves its inputs there and its
log-probs back). Its log-probs use the sampling temperature, as the policy's do, so both are
log-probs of the same kind of distribution.

Checkpoints: ``state_dict`` holds the initial weights. A resumed run must load them (not copy the
resumed policy, which is no longer the initial one). Under LoRA (the models issue) the reference is
the base model with the adapter disabled and holds no weights of its own.
"""

from __future__ import annotations

import copy

import torch

import ops

__all__ = ["ReferencePolicy"]


class ReferencePolicy:
    def __init__(self, policy: torch.nn.Module, device: torch.device | str | None = None):
        self.model = copy.deepcopy(policy)
        if device is not None:
            self.model.to(device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.device = next(self.model.parameters()).device

    @torch.no_grad()
    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                 temperature: float) -> torch.Tensor:
        """log π_ref of ``targets`` (b, L-1) given right-padded ``input_ids`` (b, L), on the inputs' device."""
        out_device = input_ids.device
        logits = self.model(input_ids=input_ids.to(self.device),
                            attention_mask=attention_mask.to(self.device), use_cache=False).logits
        lp = ops.token_logprobs(logits[:, :-1], targets.to(self.device), temperature=temperature)
        return lp.to(out_device)                                                   # (b, L-1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
