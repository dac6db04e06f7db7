"""Quotas: atomic reservations against rpm / tpm / parallel / budget limits, and their SQL."""
