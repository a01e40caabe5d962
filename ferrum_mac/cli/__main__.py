"""`python -m ferrum_mac.cli`: the same as the `ferrum` command."""

from ferrum_mac.cli import main

main()
