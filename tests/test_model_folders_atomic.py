"""Model folders are saved whole (`drafting.files.atomic_dir`, `build_pair.save_folder`): a save interrupted by an
error or Ctrl-C leaves the earlier folder (or none) and no staging folder, a finished one replaces it; a killed
save's hidden staging folder does not make a build folder look like someone else's."""
import pytest
import torch

from specpilot.drafting.files import atomic_dir
from specpilot.train.models.build_pair import check_build_folder, save_folder

from tiny import tiny_model


class Interrupted(Exception):
    pass


def test_a_finished_folder_replaces_the_earlier_one(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_dir(target) as staging:
        assert staging.is_dir() and staging.parent == tmp_path and not any(staging.iterdir())
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


@pytest.mark.parametrize("error", [Interrupted, KeyboardInterrupt])
@pytest.mark.parametrize("earlier", [True, False])
def test_an_interrupted_save_leaves_the_earlier_folder_or_none(tmp_path, error, earlier):
    model = tiny_model(seed=3)
    target = tmp_path / "target"
    if earlier:
        save_folder(model, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()} if earlier else None

    class Torn:  # writes part of a model, then fails, as a full disk or Ctrl-C would
        def save_pretrained(self, path):
            (path / "model.safetensors").write_bytes(b"\0" * 10)
            raise error("interrupted")

    with pytest.raises(error):
        save_folder(Torn(), target)
    if earlier:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
        loaded = type(model).from_pretrained(target)
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    else:
        assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["target"] if earlier else [])


def test_a_killed_saves_staging_folder_is_not_someone_elses_files(tmp_path):
    out = tmp_path / "pair"
    (out / ".target.partial-4242").mkdir(parents=True)  # left by a build killed while saving (SIGKILL)
    check_build_folder(out)
    (out / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not an earlier `specpilot models build` folder"):
        check_build_folder(out)
