"""Train privately: the session, the private step, the ledger, the gradient engines, the noise."""
