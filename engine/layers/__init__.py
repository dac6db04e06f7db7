"""Model building blocks; tensor parallelism lives inside them (see engine.distributed)."""
