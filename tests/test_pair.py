"""ModelPair loading, vocabulary checks, and the tokenizer / default pair built by `specpilot models build`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specpilot.drafting.pair import DEFAULT_PAIR_DIR, ModelPair, VocabularyMismatchError
from specpilot.train.models.build_pair import _excluded, build_pair, train_tokenizer

ROUND_TRIP_TEXTS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2.5e-3]}  # tabs\r\n",
    "Perché la città è già più bella? Sì, però...",
    "¿Dónde está el niño? ¡Mañana será otro día! Ñandú, pingüino.",
    "你好，世界！这是一个测试。中文标点：「引号」",
    "emoji 🙂🚀👩‍💻 and mixed 日本語 text",
    "   leading spaces, trailing spaces   \n\n\n\t \t\n",
    "",
    " ",
    "\x00\x01 control \x7f bytes and a lone é",
]
EMBEDDED = (DEFAULT_PAIR_DIR / "target" / "config.json").exists()


@pytest.fixture(scope="module")
def tiny_tokenizer():
    corpus = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n", "for i in range(10):\n    pass\n"]
    return train_tokenizer(corpus * 20, vocab_size=300)


def _round_trips(tok, text: str) -> bool:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(ids, skip_special_tokens=False) == text


def test_tiny_tokenizer_round_trips_exactly(tiny_tokenizer):
    for text in ROUND_TRIP_TEXTS:
        assert _round_trips(tiny_tokenizer, text), repr(text)
    assert tiny_tokenizer.eos_token == "<|endoftext|>"
    assert tiny_tokenizer.eos_token_id is not None


@pytest.mark.skipif(not EMBEDDED, reason="embedded default pair not built")
def test_embedded_tokenizer_round_trips_exactly():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_PAIR_DIR / "tokenizer"))
    for text in ROUND_TRIP_TEXTS:
        assert _round_trips(tok, text), repr(text)


@pytest.mark.skipif(not EMBEDDED, reason="embedded default pair not built")
def test_default_pair_loads_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    default = ModelPair.from_pretrained(device="cpu")
    assert default.name == "specpilot-default" and default.drafter_kind == "eagle3"  # the faster embedded drafter
    assert default.eagle.config.draft_vocab_size < default.vocab_size
    pair = ModelPair.from_pretrained(draft="embedded", device="cpu")
    assert pair.name == "specpilot-default+draft" and pair.drafter_kind == "draft_lm"
    assert pair.dtype == torch.float32  # stored bf16, run in fp32 on CPU
    assert pair.eos_token_id == pair.tokenizer.eos_token_id
    assert pair.draft.config.num_hidden_layers < pair.target.config.num_hidden_layers
    assert pair.vocab_size == pair.draft.config.vocab_size
    ids = pair.encode("def main():\n    print('ciao')\n")
    assert pair.decode(ids) == "def main():\n    print('ciao')\n"
    with torch.inference_mode():
        logits = pair.draft(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), pair.vocab_size)
    metrics = ModelPair.default_metrics()
    assert metrics is not None and "agreement_on_target_greedy" in metrics


def _tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()  # decoding-ready, as from_pretrained returns it


def test_mismatched_model_vocabularies_raise():
    with pytest.raises(VocabularyMismatchError):
        ModelPair(_tiny_llama(100), _tiny_llama(120))
    ModelPair(_tiny_llama(100), _tiny_llama(100, seed=1))  # same size: fine


def test_mismatched_tokenizers_raise(tmp_path: Path, tiny_tokenizer):
    other = train_tokenizer(["SELECT * FROM t WHERE a = 1;\n", "<html><body>ciao</body></html>\n"] * 20,
                            vocab_size=300)
    assert other.get_vocab() != tiny_tokenizer.get_vocab()
    for name, tok in (("a", tiny_tokenizer), ("b", other)):
        _tiny_llama(512).save_pretrained(tmp_path / name)  # same logits size, so only the tokenizers differ
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(VocabularyMismatchError):
        ModelPair.from_pretrained(target=tmp_path / "a", draft=tmp_path / "b", device="cpu")
    with pytest.raises(VocabularyMismatchError):  # the draft's own tokenizer is compared with an explicit one too
        ModelPair.from_pretrained(target=tmp_path / "a", draft=tmp_path / "b", tokenizer=tmp_path / "a", device="cpu")
    pair = ModelPair.from_pretrained(target=tmp_path / "a", draft=tmp_path / "a", device="cpu")
    assert pair.vocab_size == 512


def test_corpus_exclusions():
    assert _excluded(Path("test/test_os.py"))
    assert _excluded(Path("idlelib/editor.py"))
    assert _excluded(Path("site-packages/torch/__init__.py"))
    assert _excluded(Path("_sysconfigdata__linux_x86_64-linux-gnu.py"))
    assert not _excluded(Path("json/decoder.py"))


def test_quick_build_smoke(tmp_path: Path):
    metrics = build_pair(tmp_path, quick=True)
    for sub in ("tokenizer", "target", "draft"):
        assert (tmp_path / sub).is_dir()
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "corpus_manifest.json").exists()
    assert set(metrics["agreement_on_target_greedy"]) == {"test", "idlelib"}
    assert 0.0 <= metrics["agreement_on_target_greedy"]["test"]["agreement"] <= 1.0
    assert metrics["decode_cost"]["threads_1"]["ratio"] > 0
    assert metrics["target"]["train"]["steps"] == metrics["target"]["train"]["steps_planned"]
    pair = ModelPair.from_pretrained(target=tmp_path / "target", draft=tmp_path / "draft",
                                     tokenizer=tmp_path / "tokenizer", device="cpu")
    assert pair.eos_token_id == pair.tokenizer.eos_token_id


def test_quick_target_build_is_deterministic(tmp_path: Path):
    """Same seed and step budget: byte-identical weights, however long each step took."""
    for name in ("a", "b"):
        build_pair(tmp_path / name, quick=True, target_only=True)
    assert (tmp_path / "a" / "target" / "model.safetensors").read_bytes() == \
        (tmp_path / "b" / "target" / "model.safetensors").read_bytes()
    assert not (tmp_path / "a" / "draft").exists()


def test_draft_init_from_target():
    from specpilot.train.models.build_pair import init_draft_from_target
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama(hidden: int, layers: int):
        torch.manual_seed(hidden + layers)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=layers,
                                            num_attention_heads=2, num_key_value_heads=2,
                                            intermediate_size=2 * hidden, tie_word_embeddings=True))

    target, same, narrow = llama(32, 2), llama(32, 1), llama(16, 1)
    init_draft_from_target(same, target)
    assert torch.equal(same.get_input_embeddings().weight, target.get_input_embeddings().weight)
    init_draft_from_target(narrow, target)
    e_t, e_d = target.get_input_embeddings().weight, narrow.get_input_embeddings().weight
    assert e_d.shape == (64, 16)
    assert torch.allclose(e_d.norm(dim=1).mean(), e_t.norm(dim=1).mean(), rtol=1e-4)


def test_model_digest_ignores_thread_count_and_sees_weight_changes():
    from tiny import tiny_model

    from specpilot.drafting.pair import model_digest

    model = tiny_model(vocab=64, eos=0)
    threads = torch.get_num_threads()
    try:
        digests = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            digests.add(model_digest(model))
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 1
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    assert model_digest(model) not in digests


def test_local_folders_given_relative_are_recorded_absolute(saved_pair, monkeypatch):
    """Manifests and exports name the models by these paths and are read from other working directories."""
    from specpilot.drafting import ModelPair
    from specpilot.train.scale.cluster import PairSpec

    monkeypatch.chdir(saved_pair)
    identity = ModelPair.from_pretrained("target", "./draft", device="cpu").identity()
    assert identity["target"] == str(saved_pair / "target") and identity["draft"] == str(saved_pair / "draft")
    spec = PairSpec("target", "draft")   # what Ray workers load, whatever directory they start in
    assert (spec.target, spec.draft) == (str(saved_pair / "target"), str(saved_pair / "draft"))
    assert PairSpec("org/model", "org/draft").target == "org/model"   # hub ids stay as they are
