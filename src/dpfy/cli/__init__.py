"""The dpfy command line."""
