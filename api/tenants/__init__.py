"""Tenants: the tenant service and what the engine is told about a request's tenant (tenancy)."""
