"""`python -m longreach ...` runs the `longreach` command (for machines where the console script is not installed)."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
