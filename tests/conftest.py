import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(__file__))
# Tests use tiny models: intra-op threads only add synchronisation cost, and stall when cores are shared.
torch.set_num_threads(1)
