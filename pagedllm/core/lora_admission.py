"""How many distinct LoRA adapters may run at once: at most `max_loras` (the model's adapter slots).

The scheduler schedules every running request each step (budget permitting), so bounding the adapters of
`running` bounds every step. A waiting request whose adapter would be one too many is refused admission;
the scheduler then keeps it at the head of the queue (strict order, as when blocks run out): the requests
behind it do not overtake it, so a stream of requests for the adapters already running cannot starve it.
It is admitted once a running adapter's last request finishes or is preempted.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.request import Request


class LoRASlotLimit:
    """Admission check: would `request` keep the running requests within `max_loras` distinct adapters?"""

    def __init__(self, max_loras: int) -> None:
        assert max_loras >= 1, "LoRAConfig validates max_loras"
        self.max_loras = max_loras

    def admits(self, request: Request, running: Iterable[Request]) -> bool:
        """True if `request` may join `running`: it uses the base model or an adapter already running, or
        fewer than max_loras adapters are running."""
        if request.lora_request is None:
            return True
        running_ids = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        return request.lora_request.lora_int_id in running_ids or len(running_ids) < self.max_loras
