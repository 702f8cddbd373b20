"""``python -m mqbench``: the ``mqbench`` command (also what ``torchrun -m mqbench`` runs)."""

import sys

from mqbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
