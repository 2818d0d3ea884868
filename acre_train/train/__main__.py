"""``python -m acre_train.train RECIPE k=v`` (and ``torchrun -m`` / ``deepspeed --module``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
