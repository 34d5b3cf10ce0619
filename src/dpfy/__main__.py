"""``python -m dpfy`` runs the command line."""

from dpfy.cli import main

main()
