"""transformers older than 5.24 take `cache=` into **kwargs without a word and decode with no cache: such a release
is refused before any model loads, with the version found and the pip command, one line in the CLI."""
from __future__ import annotations

import pytest

from specpilot.cli import main
from specpilot.drafting.cache import MIN_TRANSFORMERS, check_transformers
from specpilot.drafting.errors import DependencyError, is_user_error
from specpilot.drafting.pair import ModelPair
from tiny import noisy_copy, tiny_model


@pytest.mark.parametrize("version", ["5.0.0", "5.17.0", "5.23.9", "5.24.0.dev0"])
def test_releases_without_the_cache_keyword_are_refused(version):
    with pytest.raises(DependencyError, match=rf"transformers >= {MIN_TRANSFORMERS}.*has transformers {version}"):
        check_transformers(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0", "5.40.1"])
def test_releases_with_it_pass(version):
    check_transformers(version)


def test_the_installed_release_passes():
    check_transformers()


def test_a_pair_is_refused_before_anything_runs(monkeypatch):
    target = tiny_model()
    draft = noisy_copy(target, 0.3)
    monkeypatch.setattr("transformers.__version__", "5.17.0")  # the module sys.modules holds when the test runs
    with pytest.raises(DependencyError, match="pip install 'transformers>=5.24,<6'") as refusal:
        ModelPair(target, draft)
    assert is_user_error(refusal.value)
    with pytest.raises(DependencyError):
        ModelPair.from_pretrained()


def test_the_cli_says_it_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("transformers.__version__", "5.17.0")  # the module sys.modules holds when the test runs
    code = main(["generate", "--prompt", "def f(x):", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "transformers 5.17.0" in err[0] and ">= 5.24" in err[0], err
