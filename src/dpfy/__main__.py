"""``python -m dpfy`` runs the command line."""

from dpfy.cli.app import main

main()
