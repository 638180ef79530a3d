"""`python -m ninfer ...`: the command-line entry point (the server joins here with the HTTP issue)."""

from ninfer.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
