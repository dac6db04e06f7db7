"""Multi-LoRA serving: PEFT adapters over the base model, mixed in one batch.

request.py   LoRARequest (the adapter a request names; plain data, no torch)
adapter.py   reading and validating a PEFT folder against the base model, sharding for TP
layers.py    a linear layer's stacked per-slot A/B and the batched apply (torch or Triton)
experts.py   a mixture of experts' adapters (per expert or stacked, as peft writes them) and
             one MoE layer's slots, applied inside its experts' loop
manager.py   the runner's side: resident slots, the CPU LRU of loaded adapters, each step's
             token -> slot mapping
"""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
