"""Usage: the ledger service, what a request costs its key (accounting) and the rows of refused requests."""
