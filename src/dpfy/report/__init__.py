"""Report what a run did: typed facts, the report card's sections, pitfalls and plots."""
