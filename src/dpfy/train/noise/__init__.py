"""Where noise comes from (the sources) and how it is correlated across steps (the mechanisms)."""
