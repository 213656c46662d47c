import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# Every test process measures its own row plans (drafting/plan_cache.py): no test reads or writes the user's cache.
os.environ.setdefault("SPECPILOT_ROW_PLAN_CACHE", "0")
sys.path.insert(0, os.path.dirname(__file__))
# Tests use tiny models: intra-op threads only add synchronisation cost, and stall when cores are shared.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Modules holding a `heavy` test run first (whole modules, so their module fixtures are built once): with
    `make test`'s parallel workers (pytest-xdist) the short tests then fill in around the long ones, and no worker is
    left running a long test alone at the end."""
    heavy_modules = {getattr(item, "module", None) for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: getattr(item, "module", None) not in heavy_modules)  # stable: order kept otherwise


@pytest.fixture(scope="session")
def saved_pair(tmp_path_factory):
    """A tiny target/draft pair with a real byte-level BPE tokenizer, saved to disk (target/, draft/)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny import noisy_copy, tiny_model

    root = tmp_path_factory.mktemp("pair")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    target = tiny_model(vocab=len(fast), eos=fast.eos_token_id)
    draft = noisy_copy(target, 0.2)
    for name, model in [("target", target), ("draft", draft)]:
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)
    return root


@pytest.fixture(scope="session")
def ray_pool(saved_pair):
    """A local Ray (2 CPUs, no dashboard) with two CPU workers, each loading `saved_pair` by path on 1 thread.
    Session-scoped: Ray and the workers start once (~20 s) for every test module that uses them."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'specpilot[ray]'")
    from specpilot.train.scale.cluster import PairSpec, WorkerPool, connect, shutdown

    connect("local", num_cpus=2)
    pool = WorkerPool(PairSpec(str(saved_pair / "target"), str(saved_pair / "draft"), device="cpu"), workers=2)
    yield pool
    pool.close()
    shutdown()
