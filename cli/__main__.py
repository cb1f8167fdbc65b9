"""`python -m cli`: the `shardsmith` command."""

from cli.main import main

main()
