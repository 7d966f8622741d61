"""The critic for PPO with GAE: its own backbone with a linear value head (docs/design.md §1).

``critic_model`` names the backbone (default: the policy's path, as InstructGPT and verl start the
critic from the policy); the transformer is loaded without its LM head (``AutoModel``) and a
``Linear(hidden, 1)`` reads the last hidden state. Values are aligned with the per-token tensors of
the trainer: column c holds V of the state after tokens 0..c, the state in which token c+1 is
generated, so completion token j of a row with prompt length P has its value at column P − 1 + j,
next to its log-prob (verl's ``values[:, -response_length - 1:-1]``).

The value head starts small (normal, std = the backbone's ``initializer_range``, bias 0), so the
first values are near 0 and the first advantages near the returns, as a freshly added head in TRL
or verl. ``state_dict`` holds backbone and head (the checkpoint issue saves it next to the policy).
"""

from __future__ import annotations

import torch

__all__ = ["Critic"]


class Critic(torch.nn.Module):
    def __init__(self, path: str, dtype: torch.dtype = torch.float32, **load_kwargs):
        from transformers import AutoModel

        super().__init__()
        self.backbone = AutoModel.from_pretrained(path, dtype=dtype, **load_kwargs)
        hidden = self.backbone.config.hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, dtype=dtype)
        std = float(getattr(self.backbone.config, "initializer_range", 0.02))
        torch.nn.init.normal_(self.value_head.weight, std=std)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values (b, L-1) for right-padded ``input_ids`` (b, L): V at column c predicts from token c."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state                    # (b, L, H)
        return self.value_head(hidden[:, :-1]).squeeze(-1).float()                  # (b, L-1)
