"""Models: HF architecture registry, the Llama-family implementation, loading and conversion."""
