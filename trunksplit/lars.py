"""LARS: layer-wise adaptive rate scaling, as vissl ran it for SimCLR and SwAV at large batch."""
import torch


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step is scaled, per parameter, by a trust ratio (You et al. 2017):
    vissl's LARC (apex's, ``clip=False``) around ``torch.optim.SGD``.

    For a parameter ``w`` with gradient ``g`` in a group with ``lars=True``, the step direction is
    ``(g + wd * w) * eta * |w| / (|g| + wd * |w| + eps)``, or ``g + wd * w`` where ``|w|`` or
    ``|g|`` is zero; a group with ``lars=False`` takes plain SGD's direction. The momentum buffer
    then follows SGD's (no dampening, no Nesterov): the state is one buffer per parameter, as SGD's.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 1e-8):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(f"LARS takes lr, momentum, weight_decay >= 0 and trust_coefficient > 0; got {lr}, {momentum}, {weight_decay}, {trust_coefficient}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps, lars=True))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        wd = group["weight_decay"]
        direction = p.grad.add(p, alpha=wd) if wd else p.grad.clone()
        if group["lars"]:
            w, g = torch.linalg.vector_norm(p), torch.linalg.vector_norm(p.grad)
            trust = group["trust_coefficient"] * w / (g + wd * w + group["eps"])
            direction.mul_(torch.where((w > 0) & (g > 0), trust, torch.ones_like(trust)))
        state = self.state[p]
        if group["momentum"]:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = direction
            else:
                direction = state["momentum_buffer"].mul_(group["momentum"]).add_(direction)
        p.add_(direction, alpha=-group["lr"])
