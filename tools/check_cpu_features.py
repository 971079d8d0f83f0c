#!/usr/bin/env python3
"""Same report as `python -m ktfp8.cpu`: CPU flags, OS support, compiled variants, usable backends."""
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
if (CHECKOUT / "ktfp8" / "__init__.py").exists():
    sys.path.insert(0, str(CHECKOUT))  # run from a source checkout: report on this tree's build
from ktfp8.cpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
