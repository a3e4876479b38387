"""One leg of a resumable run, in a fresh process: serve batches, maybe stop, write the stream and the state.

python -m tests.loader.resume_script OUT.json --setting JSON [--load STATE] [--stop-after N] [--epochs E]

The stream is one entry per batch: [epoch, mode, indices, values] where values are the served "x"
means (they encode the generation that produced them for cached epochs). The stats are one entry
per epoch: [epoch, mode, dataset calls, samples read, samples adopted, committed].
"""

from __future__ import annotations

import argparse
import json
import os
import pickle

import numpy as np

from loader import CachedLoader

from .datasets import ArangeDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--setting", required=True)
    parser.add_argument("--load", default=None)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--die", action="store_true", help="exit at once after the state, closing nothing")
    args = parser.parse_args()
    setting = json.loads(args.setting)
    loader = CachedLoader(ArangeDataset, setting["params"], batch_size=setting["batch_size"],
                          nb_worker=setting["nb_worker"], seed=setting.get("seed"),
                          cache_setting=setting.get("cache"), rotation_setting=setting.get("rotation"))
    if args.load:
        with open(args.load, "rb") as f:
            loader.load_state_dict(pickle.load(f))
    stream: list = []
    state = None
    with loader:
        for _ in range(loader.epoch, args.epochs):
            for batch in loader:
                stream.append([loader.epoch, str(loader.epoch_stats[-1].mode), batch["y"].tolist(),
                               np.asarray(batch["x"]).reshape(len(batch["y"]), -1).mean(axis=1).round(4).tolist()])
                if args.stop_after is not None and len(stream) == args.stop_after:
                    state = loader.state_dict()
                    if args.die:  # as a preempted job that saved its checkpoint: nothing is closed
                        with open(args.out, "w") as f:
                            json.dump({"stream": stream, "state": pickle.dumps(state).hex(), "stats": []}, f)
                        os._exit(0)
                    break
            if state is not None:
                break
        final = state if state is not None else loader.state_dict()
        stats = [[s.epoch, str(s.mode), s.computed, s.read, s.extra.get("adopted", 0), s.committed]
                 for s in loader.epoch_stats]
    with open(args.out, "w") as f:
        json.dump({"stream": stream, "state": pickle.dumps(final).hex(), "stats": stats}, f)


if __name__ == "__main__":
    main()
