"""Run by tests/test_distributed.py under ``torchrun --nproc-per-node 2``: the quick reproduce
pipeline on the tiny Gemma with its sweeps sharded over the two ranks.

usage: sharded_reproduce.py OUT_DIR
"""

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

from cpsuper.cli import main  # noqa: E402

sys.exit(main(["reproduce", "--model", "tiny-gemma", "--quick", "--out", sys.argv[1]]))
