"""``python -m loadlab.sim ARGS``: run the simulated SGLang server."""

from loadlab.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
