"""``python -m flash_attn.training`` (and ``torchrun -m flash_attn.training``): see flash_attn.training.cli."""
import sys

from flash_attn.training.cli import main

sys.exit(main())
