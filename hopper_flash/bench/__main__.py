"""``python -m hopper_flash.bench [options]`` is ``hopper-flash bench [options]``."""

import sys

from .cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
