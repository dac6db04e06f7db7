"""API keys: authentication (key -> principal), the key service and its fields."""
