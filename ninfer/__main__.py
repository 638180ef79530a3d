"""`python -m ninfer [ARTIFACT] [options]`: the server (the demo model without ARTIFACT);
`python -m ninfer generate|convert|inspect ...`: the other commands."""

from ninfer.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
