"""dpfy."""
