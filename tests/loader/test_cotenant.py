"""The loader in a prefix other users can write (mode 0777, no sticky bit): a rotation window, a
state and the ranks' files are input there; what a co-tenant does ends in a CacheStoreError
naming the file (a ValueError for a state, as for any damaged one) or in correct values, never
in its code running, a hang, or a file outside the prefix written or removed.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cachestore import CacheStoreError, NotRegularFileError, SymlinkError, UnsupportedSampleError, UntrustedOwnerError
from cachestore.errors import MalformedFileError
from cachestore.format import codec, records
from loader import CachedLoader
from loader import distributed
from loader.epochs.windows import DiskWindow

from ..cachestore.helpers import Opaque, planted_sample
from ..cotenant import OTHER, as_cotenant, shared_prefix  # noqa: F401 (a fixture)
from .datasets import ArangeDataset

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- the rotation window


def _hijack_window(window_dir: Path, marker: str) -> None:
    """Rename the job's window aside and put one of the co-tenant's in its place: slot 0 a pickle
    that runs code when loaded, slot 1 a sound record of other values."""
    os.rename(window_dir, window_dir.with_name(window_dir.name + "-aside"))
    window_dir.mkdir(mode=0o777)
    (window_dir / "slot-0.rec").write_bytes(
        records.encode_record(*codec.flatten(planted_sample(marker, 0), allow_pickle=True)))
    (window_dir / "slot-1.rec").write_bytes(
        records.encode_record(*codec.flatten({"x": np.full(3, -1.0), "y": -1})))


def test_a_window_swapped_by_a_cotenant_is_never_read(shared_prefix):
    marker = str(shared_prefix / "code-ran")
    window = DiskWindow(str(shared_prefix), slots=2)
    try:
        assert window.path.stat().st_mode & 0o777 == 0o700, "a window is its user's alone"
        window.put(0, {"x": np.zeros(3), "y": 0})
        window.put(1, {"x": np.ones(3), "y": 1})
        as_cotenant(_hijack_window, window.path, marker)
        assert window.get(0)["y"] == 0 and window.get(1)["y"] == 1  # its own files, through its fd
        window.put(0, {"x": np.full(3, 2.0), "y": 2})
        assert window.get(0)["y"] == 2
    finally:
        window.close()
    assert not os.path.exists(marker), "the co-tenant's code ran in the job"
    assert (shared_prefix / window.path.name / "slot-0.rec").exists(), "the co-tenant's files are not the job's"


def _plant_dead_window(prefix: Path, marker: str) -> None:
    """A window of a dead process of the co-tenant's, at the position a resumed run asks for."""
    window = prefix / "rotation-999999999-abcd"
    window.mkdir()
    (window / "position.json").write_text(json.dumps({"epoch": 0, "applied": 1, "clean": True, "slots": 2}))
    (window / "slot-0.rec").write_bytes(
        records.encode_record(*codec.flatten(planted_sample(marker, 0), allow_pickle=True)))


def test_a_cotenants_window_is_never_adopted(shared_prefix):
    marker = str(shared_prefix / "code-ran")
    as_cotenant(_plant_dead_window, shared_prefix, marker)
    window = DiskWindow(str(shared_prefix), slots=2, allow_pickle=True)
    try:
        assert not window.adopt(str(shared_prefix / "rotation-999999999-abcd"), 0, 1)
        assert window.held() == 0
        with pytest.raises(FileNotFoundError):
            window.get(0)
    finally:
        window.close()
    assert not os.path.exists(marker)


def test_a_fifo_slot_is_never_read(shared_prefix):
    window = DiskWindow(str(shared_prefix), slots=1)
    try:
        window.put(0, {"y": 0})
        os.unlink(window.path / "slot-0.rec")
        os.mkfifo(window.path / "slot-0.rec")
        with pytest.raises(NotRegularFileError, match="slot-0.rec"):
            window.get(0)
    finally:
        window.close()


def test_a_window_never_unpickles_without_allow_pickle(tmp_path):
    window = DiskWindow(str(tmp_path / "p"), slots=1)
    try:
        with pytest.raises(UnsupportedSampleError, match=r"rotation_setting\['allow_pickle'\]"):
            window.put(0, {"o": Opaque(3)})
        window._write("slot-0.rec", records.encode_record(
            *codec.flatten(planted_sample(str(tmp_path / "ran"), 0), allow_pickle=True)))
        with pytest.raises(CacheStoreError, match="allow_pickle"):
            window.get(0)
        assert not (tmp_path / "ran").exists()
    finally:
        window.close()
    allowed = DiskWindow(str(tmp_path / "q"), slots=1, allow_pickle=True)
    try:
        allowed.put(0, {"o": Opaque(3)})
        assert allowed.get(0)["o"] == Opaque(3)
    finally:
        allowed.close()


def test_a_loader_rotating_on_disk_takes_allow_pickle_from_its_setting(tmp_path):
    with pytest.raises(ValueError, match="allow_pickle"):
        CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0,
                     rotation_setting={"medium": "disk", "rotation": 2, "size": 4, "prefix": str(tmp_path),
                                       "allow_pickle": "yes"})
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0,
                      rotation_setting={"medium": "disk", "rotation": 2, "size": 4, "prefix": str(tmp_path / "r"),
                                        "allow_pickle": True}) as loader:
        assert sorted(y for b in loader for y in b["y"].tolist()) == sorted(list(range(8)) * 2)


# ----------------------------------------------------------------------------- a swapped generation


def _copy_generation_as_own(prefix: Path) -> None:
    """The co-tenant puts a copy of the job's generation, now its own, in place of the job's."""
    shutil.copytree(prefix / "gen-000000", prefix / ".copy")
    os.rename(prefix / "gen-000000", prefix / f".aside-{os.getpid()}")
    os.rename(prefix / ".copy", prefix / "gen-000000")


def _epoch(prefix: Path, **cache: object) -> tuple[str, list[int]]:
    with CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": str(prefix), **cache}) as loader:
        ys = sorted(y for b in loader for y in b["y"].tolist())
        return str(loader.epoch_stats[0].mode), ys


def test_a_generation_another_user_put_in_place_is_computed_again_not_served(shared_prefix):
    assert _epoch(shared_prefix) == ("generate", list(range(12)))
    as_cotenant(_copy_generation_as_own, shared_prefix)
    assert (shared_prefix / "gen-000000").stat().st_uid == OTHER
    assert _epoch(shared_prefix) == ("generate", list(range(12))), "another user's generation was served"
    assert (shared_prefix / "gen-000000").stat().st_uid == os.geteuid()
    as_cotenant(_copy_generation_as_own, shared_prefix)
    assert _epoch(shared_prefix, trusted_uids=[OTHER]) == ("read", list(range(12)))


# ----------------------------------------------------------------------------- a forged state


def _state(prefix: Path) -> tuple[dict, dict]:
    args = {"dataset_params": {"n": 20}, "batch_size": 4, "nb_worker": 0, "seed": 1,
            "cache_setting": {"prefix": str(prefix), "update_frequency": 3}}
    with CachedLoader(ArangeDataset, **args) as cached:
        return cached.state_dict(), args


def test_a_state_whose_fallback_names_a_directory_outside_is_refused(tmp_path):
    outside = tmp_path / "home"
    victim = outside / "rotation-999999999-abcd"  # what a sweep of dead windows would remove
    victim.mkdir(parents=True)
    (victim / "thesis.tex").write_text("years of work")
    state, args = _state(tmp_path / "cache")
    state = {**state, "rotation_fallback": {"medium": "disk", "rotation": 3, "size": 8, "prefix": str(outside)}}
    with CachedLoader(ArangeDataset, **args) as other:
        with pytest.raises(ValueError, match="rotation_fallback"):
            other.load_state_dict(state)
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_a_state_cannot_turn_pickles_on(tmp_path):
    state, args = _state(tmp_path / "cache")
    state = {**state, "rotation_fallback": {"medium": "disk", "rotation": 3, "size": 8,
                                            "prefix": str(tmp_path / "cache"), "allow_pickle": True}}
    with CachedLoader(ArangeDataset, **args) as other:
        with pytest.raises(ValueError, match="allow_pickle"):
            other.load_state_dict(state)


@pytest.mark.parametrize("field", ["epoch", "base", "seed"])
def test_absurd_numbers_in_a_state_are_refused(tmp_path, field):
    state, args = _state(tmp_path / "cache")
    if field == "base":
        state = {**state, "cache": {"base": 10 ** 30, "off": False, "refresh_off": False}}
    else:
        state = {**state, field: 10 ** 60 if field == "seed" else 10 ** 30}
        if field == "seed":
            args = {**args, "seed": None}
    with CachedLoader(ArangeDataset, **args) as other:
        with pytest.raises(ValueError, match="cache" if field == "base" else field):
            other.load_state_dict(state)
    assert not list((tmp_path / "cache").glob("gen-*"))


# ----------------------------------------------------------------------------- the ranks' files


@pytest.fixture
def rendezvous(shared_prefix, monkeypatch):
    """The directory rank 0 of a two-rank torchrun job meets the other in, under `shared_prefix`."""
    monkeypatch.setattr(distributed, "_rendezvous_count", itertools.count())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    import hashlib
    return shared_prefix / f".ranks-{hashlib.sha256(b'job-0-0').hexdigest()[:16]}"


def _link(where: Path, target: Path) -> None:
    where.symlink_to(target)


def test_a_linked_rendezvous_is_refused_not_written_through(rendezvous, tmp_path):
    outside = Path(f"{rendezvous.parent}-outside")
    outside.mkdir(mode=0o777)
    try:
        as_cotenant(_link, rendezvous, outside)
        with pytest.raises(SymlinkError, match=rendezvous.name):
            distributed._gather_by_files({"fingerprint": "f", "params": {}}, 2, 0, str(rendezvous.parent))
        assert not any(outside.iterdir()), "rank 0 wrote outside the prefix"
    finally:
        shutil.rmtree(outside)


def _answer_for_rank_1(where: Path) -> None:
    where.mkdir(mode=0o777)
    (where / "rank-1.json").write_text(json.dumps({"value": {"fingerprint": "theirs", "params": {}}}))


def test_a_cotenants_rendezvous_is_refused(rendezvous):
    as_cotenant(_answer_for_rank_1, rendezvous)
    with pytest.raises(UntrustedOwnerError, match=f"belongs to user {OTHER}"):
        distributed._gather_by_files({"fingerprint": "f", "params": {}}, 2, 0, str(rendezvous.parent))


def _fifo_rank_file(where: Path) -> None:
    os.mkfifo(where / "rank-1.json")


def test_rank_files_that_are_fifos_links_or_forged_are_errors_naming_them(rendezvous, tmp_path, monkeypatch):
    rendezvous.mkdir(mode=0o777)
    rendezvous.chmod(0o777)
    as_cotenant(_fifo_rank_file, rendezvous)
    os.lchown(rendezvous / "rank-1.json", 0, 0)  # even of this user: a FIFO is no rank's file

    def gather() -> None:
        monkeypatch.setattr(distributed, "_rendezvous_count", itertools.count())  # the same rendezvous again
        distributed._gather_by_files({"fingerprint": "f", "params": {}}, 2, 0, str(rendezvous.parent))

    with pytest.raises(NotRegularFileError, match="rank-1.json"):
        gather()
    (rendezvous / "rank-1.json").unlink()
    (rendezvous / "rank-1.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(SymlinkError, match="rank-1.json"):
        gather()
    (rendezvous / "rank-1.json").unlink()
    (rendezvous / "rank-1.json").write_text(json.dumps({"fingerprint": "f"}))
    with pytest.raises(MalformedFileError, match="rank-1.json"):
        gather()


@pytest.mark.parametrize("key,value", [("trusted_uids", "alice"), ("trusted_gids", [-1]),
                                       ("max_sample_bytes", "lots")])
def test_the_cache_settings_of_trust_are_checked(tmp_path, key, value):
    with pytest.raises(ValueError, match=key if key != "max_sample_bytes" else "size"):
        CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0,
                     cache_setting={"prefix": str(tmp_path), key: value})
