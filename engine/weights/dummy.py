"""Random ("dummy") weights for a named shape: speed does not depend on weight
values, so benchmarks of the 27B shape need no 54 GB download."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.model import CausalLM, GatedDeltaNet, GatedRMSNorm, RMSNorm


@torch.no_grad()
def randomize(model: CausalLM, seed: int = 0) -> None:
    """Fill every parameter with values of a sensible scale (so activations stay
    finite through many layers), deterministically from `seed`."""
    gens: dict[torch.device, torch.Generator] = {}

    def generator(t: torch.Tensor) -> torch.Generator:
        # one stream per device: a table kept in host memory draws from its own
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        return gens[t.device]

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            fan_in = module.weight.shape[-1]
            std = 0.02 if isinstance(module, nn.Embedding) else 1 / math.sqrt(fan_in)
            module.weight.normal_(0.0, std, generator=generator(module.weight))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(0.0 if module.zero_centered else 1.0)
        elif isinstance(module, GatedRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, GatedDeltaNet):
            kernel = module.conv1d.weight.shape[-1]
            module.conv1d.weight.normal_(0.0, 1 / math.sqrt(kernel),
                                        generator=generator(module.conv1d.weight))
            module.dt_bias.fill_(1.0)
            module.A_log.uniform_(0.0, math.log(16.0), generator=generator(module.A_log))
