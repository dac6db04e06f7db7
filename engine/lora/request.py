"""LoRARequest: which adapter a request runs with (vLLM's name and fields).

    req = LoRARequest("sql", 1, "/adapters/sql-lora")
    llm.generate(prompts, params, lora_request=req)

lora_int_id is the adapter's identity across the engine (slots, the CPU cache, the prefix
cache's block hashes); lora_name is what it is called; lora_path is a PEFT folder
(adapter_config.json + adapter_model.safetensors). Plain data: no torch, sent to tensor-parallel
workers inside NewRequestData.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")

    @property
    def cache_key(self) -> bytes:
        """What the prefix cache mixes into a request's first block hash: blocks computed
        with one adapter are never served to a request of another (or of the base model).
        Starts with 0xff, which no UTF-8 cache salt does, so it never equals a salt."""
        name = self.lora_name.encode()
        return (
            b"\xfflora"
            + self.lora_int_id.to_bytes(8, "little")
            + len(name).to_bytes(4, "little")
            + name
        )
