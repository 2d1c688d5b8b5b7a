"""Average a run's weight versions after the fact: the model that `--weight-average-decay D` would have scored.

    python benchmarks/studies/average_checkpoints.py START_MODEL CHECKPOINTS_DIR OUT_DIR --decay 0.7

START_MODEL is the weights the run started from (version 0: the warm start, `model_dir` in the report's
prepare.json); CHECKPOINTS_DIR holds the run's `v<version>` model directories (`agent_rl --checkpoint-every 1`).
The average starts at START_MODEL and takes each checkpoint in version order with the trainer's own update
(`gyre.engines.trainer.ema_update`), so with a checkpoint of every version it equals the core's in-run average.
One run's checkpoints then give the averaged model of any decay, to be scored with benchmarks/studies/heldout_passk.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from gyre.engines.model_format import load_hf_state_dict, save_model_dir
from gyre.engines.trainer import ema_update

_VERSION_DIR = re.compile(r"^v(\d+)$")


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """The `v<version>` directories under `root`, in version order. Raises FileNotFoundError when there are none."""
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _VERSION_DIR.match(p.name)))
    if not found:
        raise FileNotFoundError(f"no v<version> checkpoint directories in {root}")
    return found


def average_checkpoints(start: Path, root: Path, out: Path, decay: float) -> list[int]:
    """Write the moving average (this decay per version) of `start` followed by the checkpoints to `out`, a complete
    model directory; returns the versions averaged. Raises ValueError when the checkpoints' tensors differ from the
    start's, or the decay is outside [0, 1)."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    average = {name: tensor.float().clone() for name, tensor in load_hf_state_dict(start).items()}
    versions = []
    for version, path in checkpoint_dirs(root):
        weights = load_hf_state_dict(path)
        if weights.keys() != average.keys() or any(weights[n].shape != average[n].shape for n in average):
            raise ValueError(f"checkpoint {path} does not have the tensors of {start}")
        for name, tensor in average.items():
            ema_update(tensor, weights[name].float(), decay)
        versions.append(version)
    save_model_dir(start, out, average)
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("start_model", type=Path)
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--decay", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        versions = average_checkpoints(args.start_model, args.checkpoints, args.out, args.decay)
    except (OSError, ValueError) as error:
        print(f"average_checkpoints: {error}", file=sys.stderr)
        return 2
    print(f"averaged versions {versions[0]}..{versions[-1]} ({len(versions)}) at decay {args.decay} into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
