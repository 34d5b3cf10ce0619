"""Plan a private run before training: accounting, mechanisms, the privacy plan (no torch)."""
