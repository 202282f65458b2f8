"""``python -m tools.compare_loss ...``"""

import sys

from tools.compare_loss.cli import main

if __name__ == "__main__":
    sys.exit(main())
