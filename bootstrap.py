#!/usr/bin/env python3
"""rig without pixi: `python3 bootstrap.py <invoke task> [args]` sets up .venv, then runs the task.

Needs only python3 (>= 3.11) and pip; see rig/env/bootstrap.py for what it does and why.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rig.env.bootstrap import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
