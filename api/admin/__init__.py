"""The admin REST API (/admin/v1): routes and wire schemas for keys, tenants, usage and the engine."""
