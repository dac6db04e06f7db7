"""The quota hot path's SQL, one text for Postgres and SQLite (run by api/db/raw_store.py).

Constant statements with numbered parameters ($N; SQLite reads them as ?N), nothing built
from values. Times in quota_leases and budget_period_start are epoch seconds (float); the
keys' expires_at is a timestamp column, bound as the store's timestamp(). CASTs fix the
parameter types Postgres would otherwise infer from the CASE branches.
"""

from __future__ import annotations

# The period the key's budget counts in now: $3 = start of today, $4 = of this month (UTC).
# (Written out in each statement below: SQL has no named sub-expressions in an UPDATE.)

# Reserve $2 tokens for key $1 if they fit in the budget of the current period; $5 = now.
# Returns the key's window limits and the period the reservation belongs to, or no row when
# the key is revoked, expired, unknown, or its budget is spent. Row-locks the key (Postgres)
# until the transaction ends; SQLite's BEGIN IMMEDIATE serialises writers anyway.
RESERVE = """
UPDATE api_keys
SET budget_used = CASE WHEN budget_period_start = CASE budget_period
            WHEN 'day' THEN CAST($3 AS DOUBLE PRECISION)
            WHEN 'month' THEN CAST($4 AS DOUBLE PRECISION)
            ELSE 0.0 END
        THEN budget_used ELSE 0 END + $2,
    budget_period_start = CASE budget_period
            WHEN 'day' THEN CAST($3 AS DOUBLE PRECISION)
            WHEN 'month' THEN CAST($4 AS DOUBLE PRECISION)
            ELSE 0.0 END
WHERE id = $1
    AND revoked_at IS NULL
    AND (expires_at IS NULL OR expires_at > $5)
    AND (token_budget IS NULL OR CASE WHEN budget_period_start = CASE budget_period
            WHEN 'day' THEN CAST($3 AS DOUBLE PRECISION)
            WHEN 'month' THEN CAST($4 AS DOUBLE PRECISION)
            ELSE 0.0 END
        THEN budget_used ELSE 0 END + $2 <= token_budget)
RETURNING rpm_limit, tpm_limit, max_parallel, budget_period_start
"""

# Why RESERVE matched no row.
KEY_STATE = """
SELECT revoked_at, expires_at, token_budget, budget_used, budget_period, budget_period_start
FROM api_keys WHERE id = $1
"""

# Key $1's sliding window since $2 (requests, tokens, oldest start) and its leases still
# held at $3. A request weighs its reservation until released, its used tokens after.
WINDOW_STATS = """
SELECT
    COALESCE(SUM(CASE WHEN created_at > $2 THEN 1 ELSE 0 END), 0),
    COALESCE(SUM(CASE WHEN created_at > $2
        THEN COALESCE(used_tokens, reserved_tokens) ELSE 0 END), 0),
    MIN(CASE WHEN created_at > $2 THEN created_at END),
    COALESCE(SUM(CASE WHEN released_at IS NULL AND expires_at > $3 THEN 1 ELSE 0 END), 0)
FROM quota_leases
WHERE key_id = $1 AND (created_at > $2 OR (released_at IS NULL AND expires_at > $3))
"""

# The requests of key $1's window since $2, oldest first, with their weight (Retry-After).
WINDOW_REQUESTS = """
SELECT created_at, COALESCE(used_tokens, reserved_tokens)
FROM quota_leases
WHERE key_id = $1 AND created_at > $2
ORDER BY created_at
"""

INSERT_LEASE = """
INSERT INTO quota_leases (id, key_id, created_at, expires_at, reserved_tokens)
VALUES ($1, $2, $3, $4, $5)
"""

# Leases of key $1 that left the window ($2) and are released or expired ($3 = now).
DELETE_OLD_LEASES = """
DELETE FROM quota_leases
WHERE key_id = $1 AND created_at <= $2 AND (released_at IS NOT NULL OR expires_at <= $3)
"""

RELEASE_LEASE = """
UPDATE quota_leases SET released_at = $2, used_tokens = $3
WHERE id = $1 AND released_at IS NULL
"""

# Give back (or charge) $2 tokens of key $1's budget, if still in the period $3.
RECONCILE = """
UPDATE api_keys
SET budget_used = CASE WHEN budget_used + $2 < 0 THEN 0 ELSE budget_used + $2 END
WHERE id = $1 AND budget_period_start = $3
"""

# Postgres, one statement in its own transaction: release lease $1 at $2 having used $3
# tokens, and give back $5 tokens to key $4's budget if still in the period $6.
RELEASE_AND_RECONCILE = """
WITH lease AS (
    UPDATE quota_leases SET released_at = $2, used_tokens = $3
    WHERE id = $1 AND released_at IS NULL
)
UPDATE api_keys
SET budget_used = CASE WHEN budget_used + $5 < 0 THEN 0 ELSE budget_used + $5 END
WHERE id = $4 AND budget_period_start = $6 AND $5 <> 0
"""

# -- Postgres: the whole acquire in one round trip ---------------------------------------------
#
# RESERVE, the window stats and the lease insert as one server-side function, created per
# connection in pg_temp (so no migration and no schema object outlives the session). It runs
# as one autocommit statement; inside a PL/pgSQL function each statement takes a fresh
# snapshot (READ COMMITTED), so the stats read after RESERVE row-locked the key see every
# lease committed by whoever held the lock before — the same guarantee as the transaction
# path. A refusal by the window limits undoes the reservation inside the same statement.
# The limit checks mirror QuotaService._check_windows, which computes the headers and
# messages from the returned stats. `period_start` NULL: RESERVE matched no row.
ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION pg_temp.tessera_quota_acquire_v1(
    p_key text, p_n bigint, p_day double precision, p_month double precision,
    p_now_ts timestamptz, p_now double precision, p_lease text, p_expires double precision)
RETURNS TABLE (admitted boolean, rpm integer, tpm bigint, parallel integer,
    period_start double precision, requests bigint, tokens bigint,
    oldest double precision, running bigint)
LANGUAGE plpgsql VOLATILE AS $fn$
#variable_conflict use_column
BEGIN
    admitted := false;
    UPDATE api_keys
    SET budget_used = CASE WHEN budget_period_start = CASE budget_period
                WHEN 'day' THEN p_day WHEN 'month' THEN p_month ELSE 0.0 END
            THEN budget_used ELSE 0 END + p_n,
        budget_period_start = CASE budget_period
                WHEN 'day' THEN p_day WHEN 'month' THEN p_month ELSE 0.0 END
    WHERE id = p_key
        AND revoked_at IS NULL
        AND (expires_at IS NULL OR expires_at > p_now_ts)
        AND (token_budget IS NULL OR CASE WHEN budget_period_start = CASE budget_period
                WHEN 'day' THEN p_day WHEN 'month' THEN p_month ELSE 0.0 END
            THEN budget_used ELSE 0 END + p_n <= token_budget)
    RETURNING rpm_limit, tpm_limit, max_parallel, budget_period_start
    INTO rpm, tpm, parallel, period_start;
    IF NOT FOUND OR (rpm IS NULL AND tpm IS NULL AND parallel IS NULL) THEN
        admitted := FOUND;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT
        COALESCE(SUM(CASE WHEN created_at > p_now - 60 THEN 1 ELSE 0 END), 0),
        COALESCE(SUM(CASE WHEN created_at > p_now - 60
            THEN COALESCE(used_tokens, reserved_tokens) ELSE 0 END), 0),
        MIN(CASE WHEN created_at > p_now - 60 THEN created_at END),
        COALESCE(SUM(CASE WHEN released_at IS NULL AND expires_at > p_now THEN 1 ELSE 0 END), 0)
    INTO requests, tokens, oldest, running
    FROM quota_leases
    WHERE key_id = p_key
        AND (created_at > p_now - 60 OR (released_at IS NULL AND expires_at > p_now));
    IF (rpm IS NOT NULL AND requests + 1 > rpm)
        OR (tpm IS NOT NULL AND tokens + p_n > tpm)
        OR (parallel IS NOT NULL AND running + 1 > parallel) THEN
        UPDATE api_keys SET budget_used = GREATEST(budget_used - p_n, 0) WHERE id = p_key;
        RETURN NEXT;
        RETURN;
    END IF;
    INSERT INTO quota_leases (id, key_id, created_at, expires_at, reserved_tokens)
    VALUES (p_lease, p_key, p_now, p_expires, p_n);
    admitted := true;
    RETURN NEXT;
END
$fn$
"""

ACQUIRE = """
SELECT admitted, rpm, tpm, parallel, period_start, requests, tokens, oldest, running
FROM pg_temp.tessera_quota_acquire_v1($1, $2, $3, $4, $5, $6, $7, $8)
"""

# -- tenants: the same checks on the tenant's row and on the leases of all its keys ------------
#
# Used (on both databases) when the key's tenant has limits of its own: one transaction that
# row-locks the tenant first, then the key (a fixed order, so two acquires cannot deadlock),
# and counts the tenant's window after taking the lock. See QuotaService._acquire.

# Reserve $2 tokens against tenant $1's budget ($3 / $4 = start of today / this month).
TENANT_RESERVE = """
UPDATE tenants
SET budget_used = CASE WHEN budget_period_start = CASE budget_period
            WHEN 'day' THEN CAST($3 AS DOUBLE PRECISION)
            WHEN 'month' THEN CAST($4 AS DOUBLE PRECISION)
            ELSE 0.0 END
        THEN budget_used ELSE 0 END + $2,
    budget_period_start = CASE budget_period
            WHEN 'day' THEN CAST($3 AS DOUBLE PRECISION)
            WHEN 'month' THEN CAST($4 AS DOUBLE PRECISION)
            ELSE 0.0 END
WHERE id = $1
    AND disabled_at IS NULL
    AND (token_budget IS NULL OR CASE WHEN budget_period_start = CASE budget_period
            WHEN 'day' THEN CAST($3 AS DOUBLE PRECISION)
            WHEN 'month' THEN CAST($4 AS DOUBLE PRECISION)
            ELSE 0.0 END
        THEN budget_used ELSE 0 END + $2 <= token_budget)
RETURNING rpm_limit, tpm_limit, max_parallel, budget_period_start
"""

# Why TENANT_RESERVE matched no row.
TENANT_STATE = """
SELECT disabled_at, token_budget, budget_used, budget_period, budget_period_start
FROM tenants WHERE id = $1
"""

TENANT_WINDOW_STATS = """
SELECT
    COALESCE(SUM(CASE WHEN created_at > $2 THEN 1 ELSE 0 END), 0),
    COALESCE(SUM(CASE WHEN created_at > $2
        THEN COALESCE(used_tokens, reserved_tokens) ELSE 0 END), 0),
    MIN(CASE WHEN created_at > $2 THEN created_at END),
    COALESCE(SUM(CASE WHEN released_at IS NULL AND expires_at > $3 THEN 1 ELSE 0 END), 0)
FROM quota_leases
WHERE tenant_id = $1 AND (created_at > $2 OR (released_at IS NULL AND expires_at > $3))
"""

TENANT_WINDOW_REQUESTS = """
SELECT created_at, COALESCE(used_tokens, reserved_tokens)
FROM quota_leases
WHERE tenant_id = $1 AND created_at > $2
ORDER BY created_at
"""

# A lease counted in both key $2's and tenant $3's windows.
INSERT_TENANT_LEASE = """
INSERT INTO quota_leases (id, key_id, tenant_id, created_at, expires_at, reserved_tokens)
VALUES ($1, $2, $3, $4, $5, $6)
"""

# Give back (or charge) $2 tokens of tenant $1's budget, if still in the period $3.
TENANT_RECONCILE = """
UPDATE tenants
SET budget_used = CASE WHEN budget_used + $2 < 0 THEN 0 ELSE budget_used + $2 END
WHERE id = $1 AND budget_period_start = $3
"""
