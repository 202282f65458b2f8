"""Train an LLM: ``torchrun --nproc_per_node=N train.py --config train_configs/llama3.toml``.

Every config key can be overridden on the command line (``--parallelism.tp 2``); run
``python train.py --help`` for the list.
"""

import sys

from trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
