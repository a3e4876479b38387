"""CachedLoader under PyTorch Lightning's ``Trainer.fit``: epochs, the cache, and a checkpoint taken mid-epoch.

Lightning (2.6) treats any train dataloader with ``state_dict`` / ``load_state_dict`` as resumable:
every checkpoint holds ``loader.state_dict()`` (``checkpoint["loops"]["fit_loop"]["state_dict"]
["combined_loader"]``, from ``FitLoop.on_save_checkpoint``). ``Trainer.fit(..., ckpt_path=...)``
hands it to the new loader's ``load_state_dict`` (``FitLoop._load_combined_loader_states``) only
when the checkpoint was taken mid-epoch (``FitLoop.restarting`` is false after a finished epoch),
and only after ``_check_dataloader_iterable`` (``trainer/connectors/data_connector.py``) has
started and dropped an iterator. Lightning calls ``set_epoch`` on a loader's ``sampler`` only,
which this loader does not have.
"""

from __future__ import annotations

import collections
import functools

import pytest

from loader import CachedLoader

from .datasets import ArangeDataset, read_calls

lightning = pytest.importorskip("lightning")
torch = pytest.importorskip("torch")
ModelCheckpoint = lightning.pytorch.callbacks.ModelCheckpoint

N, BATCH = 22, 4  # 6 batches per epoch, the last one of 2

# Lightning 2.6 builds torch's pytree LeafSpec, which torch 2.13 deprecates: nothing of ours.
pytestmark = pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")


class Recorder(lightning.LightningModule):
    """A linear model on 4 features that records the indices each training step sees."""

    def __init__(self, stream: list[tuple[int, list[int]]]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.stream = stream  # (epoch, indices of the batch) per step, in order

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x, y = batch["x"], batch["y"]
        assert torch.equal(x, y[:, None].float().expand_as(x)), "sample i is an array of i"
        self.stream.append((self.current_epoch, y.tolist()))
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(1), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def make_loader(prefix, counter_dir=None, **cache):
    return CachedLoader(ArangeDataset(n=N, shape=(4,), counter_dir=counter_dir), batch_size=BATCH, num_workers=2,
                        seed=7, device="cpu", cache_setting={"prefix": str(prefix), "update_frequency": 3, **cache})


def trainer(max_epochs, **kwargs):
    return lightning.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, **kwargs)


def per_epoch(stream):
    out = collections.defaultdict(list)
    for epoch, indices in stream:
        out[epoch].append(indices)
    return dict(out)


@pytest.mark.timeout(90)
def test_fit_serves_every_index_once_per_epoch_and_computes_once_per_generation(no_leaks):
    calls = no_leaks / "calls"
    calls.mkdir()
    stream: list = []
    # background_refresh=False: generation 2 (epochs 6-8) is not computed ahead during epochs 4-5,
    # so the count of dataset calls over 6 epochs is exact.
    with make_loader(no_leaks / "cache", str(calls), background_refresh=False) as loader:
        trainer(6, enable_checkpointing=False).fit(Recorder(stream), train_dataloaders=loader)
        stats = [(s.epoch, s.mode, s.generation) for s in loader.epoch_stats]
    epochs = per_epoch(stream)
    assert sorted(epochs) == list(range(6))
    for epoch, batches in epochs.items():
        assert sorted(i for b in batches for i in b) == list(range(N)), f"epoch {epoch}"
    assert epochs[1] != epochs[0], "a new order every epoch"
    assert stats == [(0, "generate", 0), (1, "read", 0), (2, "read", 0),
                     (3, "generate", 1), (4, "read", 1), (5, "read", 1)]
    assert collections.Counter(read_calls(str(calls))) == {i: 2 for i in range(N)}


# ---------------------------------------------------------------------------- resuming from a checkpoint
EPOCHS = 4  # generation 0 for epochs 0-2, generation 1 from epoch 3


class Stop(Exception):
    """The run dies right after a checkpoint."""


class StopAt(lightning.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Stop(f"stopped at step {self.step}")


class LoaderState(lightning.Callback):
    """Keeps the loader's state in each checkpoint and gives it back on resume, whatever the loop's state.

    Lightning restores the train dataloader's state only when the checkpoint was taken mid-epoch; this
    callback covers a checkpoint taken at the end of an epoch (ModelCheckpoint's default) too.
    ``load_state_dict`` runs while the checkpoint is restored, before Lightning first iterates the loader.
    """

    def __init__(self, loader: CachedLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loader.load_state_dict(state_dict["loader"])

    def on_train_epoch_end(self, trainer: object, module: object) -> None:
        # Before ModelCheckpoint's (Lightning runs checkpoint callbacks last): the epoch is over, so the
        # state saved now points at the next one, not at the rest (nothing) of this one.
        self.loader.set_epoch(self.loader.epoch + 1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The stream of an uninterrupted run and what each of its epochs did."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    stream: list = []
    with make_loader(tmp / "cache") as loader:
        trainer(EPOCHS, enable_checkpointing=False).fit(Recorder(stream), train_dataloaders=loader)
        stats = [(s.epoch, s.mode, s.generation) for s in loader.epoch_stats]
    return stream, stats


def interrupted_then_resumed(tmp, checkpoint, stop_step, ckpt_name, with_callback):
    """Fit until `stop_step` (dying there), then fit again from the checkpoint `ckpt_name`: the stream
    up to the checkpoint, the resumed stream, the checkpoint, and the resumed loader's epochs."""
    def callbacks(loader):
        return [checkpoint()] + ([LoaderState(loader)] if with_callback else [])

    first: list = []
    with make_loader(tmp / "cache") as loader:
        with pytest.raises(Stop):
            trainer(EPOCHS, callbacks=[StopAt(stop_step)] + callbacks(loader),
                    default_root_dir=tmp).fit(Recorder(first), train_dataloaders=loader)
    path = tmp / "checkpoints" / ckpt_name
    ckpt = torch.load(path, weights_only=False)
    second: list = []
    with make_loader(tmp / "cache") as loader:  # a new process would build it the same way
        trainer(EPOCHS, callbacks=callbacks(loader), default_root_dir=tmp).fit(
            Recorder(second), train_dataloaders=loader, ckpt_path=path)
        stats = [(s.epoch, s.mode, s.generation) for s in loader.epoch_stats]
    return first[:ckpt["global_step"]] + second, ckpt, stats


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
@pytest.mark.parametrize("step", [4, 8])  # mid epoch 0 (generate), mid epoch 1 (read)
def test_a_mid_epoch_checkpoint_resumes_the_uninterrupted_stream(no_leaks, uninterrupted, step):
    """Lightning saves ``loader.state_dict()`` in the checkpoint and loads it into the new loader."""
    golden, golden_stats = uninterrupted
    checkpoint = functools.partial(ModelCheckpoint, every_n_train_steps=step, save_top_k=-1, filename="{step}")
    resumed, ckpt, stats = interrupted_then_resumed(no_leaks, checkpoint, step, f"step={step}.ckpt",
                                                    with_callback=False)
    saved = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (saved["epoch"], saved["batches_served"]) == divmod(step, 6)
    assert resumed == golden
    # The epoch resumed in reads its generation as the uninterrupted run did; it reads it committed
    # when the interrupted run's workers had computed all of it before they stopped.
    expected = golden_stats[step // 6:]
    assert [(e, g) for e, _, g in stats] == [(e, g) for e, _, g in expected]
    assert stats[1:] == expected[1:] and stats[0][1] in (expected[0][1], "read")


@pytest.mark.timeout(90)
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_an_epoch_end_checkpoint_resumes_the_uninterrupted_stream_with_a_callback(no_leaks, uninterrupted):
    """Lightning does not give an epoch-end checkpoint's loader state back: the LoaderState callback does."""
    golden, golden_stats = uninterrupted
    checkpoint = functools.partial(ModelCheckpoint, save_top_k=-1, filename="{epoch}")  # at each epoch's end
    resumed, ckpt, stats = interrupted_then_resumed(no_leaks, checkpoint, 13, "epoch=1.ckpt", with_callback=True)
    assert ckpt["global_step"] == 12
    assert resumed == golden
    assert stats == golden_stats[2:]
