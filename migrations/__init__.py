"""Alembic migrations for Tessera's database (see api/db/migrate.py)."""
