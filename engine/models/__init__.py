"""Models: HF architecture registry, the Llama-family implementation, loading (a .gguf model converted once by engine.gguf)."""
