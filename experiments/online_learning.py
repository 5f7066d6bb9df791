"""Prints the online-learning identity checks as a table (exit status 1 if one fails).

    PYTHONPATH=. python experiments/online_learning.py

The checks live in `lineattn/experiments/online_learning.py` (tests/test_online_learning.py asserts them).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lineattn.experiments.online_learning import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
