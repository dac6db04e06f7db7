"""LoRA adapters over HTTP: the served adapters, who may call them, loading at run time."""
