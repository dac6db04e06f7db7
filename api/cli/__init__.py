"""The `tessera` command: serve, bench, keys, tenants, db."""
