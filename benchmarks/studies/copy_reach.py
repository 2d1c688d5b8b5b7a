"""How far back a model copies: teacher-forced accuracy on synthetic copies with a line of unrelated items between
the source and the copy.

    python benchmarks/studies/copy_reach.py MODEL_DIR [MODEL_DIR ...] [--gaps 0,20,60,120] [--examples 48] [--by-kind]

For each gap (in items; each item is one to three tokens) it makes `--examples` copy examples with the toolbox's
words (engines/pretrain.py `copy_examples`, `max_gap_items`=gap, so gaps are drawn from 0..gap) and prints the share
of target tokens the model gives probability above 1/2. A model pretrained only on adjacent copies scores high at
gap 0 and falls off past ~20 items; an agent needs the long reach to carry a prompt's words across its context.

`--by-kind` scores each example kind on its own (span, join, look, quote) and adds the share of examples copied
whole (every target token above 1/2): an agent's argument is right only when all of it is, and a token accuracy
of 0.85 can hide a model that gets one copy in three right (BENCHMARKS.md, session 12).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

TOOLBOX = Path(__file__).resolve().parents[2] / "examples" / "toolbox"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", nargs="+", metavar="model_dir")
    parser.add_argument("--gaps", default="0,20,60,120", help="comma-separated longest gaps, in items")
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--by-kind", action="store_true", help="score each example kind apart, with exact copies")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TOOLBOX))
    from agent import load_sibling

    from gyre.engines.chat_template import ChatTemplate
    from gyre.engines.pretrain import DEFAULT_KINDS, KINDS, CopyPretrainConfig, copy_examples
    from gyre.engines.sft import batch_tensors
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    tasks = load_sibling("tasks")
    for model_dir in args.model_dirs:
        print(model_dir, flush=True)
        template = ChatTemplate.from_model_dir(model_dir)
        trainer = MegatronTrainer(model_dir, TrainerConfig())
        for gap in (int(g) for g in args.gaps.split(",")):
            for kinds in ([(kind,) for kind in KINDS] if args.by_kind else [DEFAULT_KINDS]):
                config = CopyPretrainConfig(words=tasks.WORDS + tasks.ITEMS, max_gap_items=gap, kinds=kinds)
                rng = random.Random(f"reach:{gap}" if kinds == DEFAULT_KINDS else f"reach:{gap}:{kinds[0]}")
                ids, lengths, mask = batch_tensors(copy_examples(template, config, rng, args.examples))
                right = (trainer.logprobs(ids, lengths) > -0.6931).float() * mask
                accuracy = float(right.sum() / mask.sum())
                line = f"  gap <= {gap:4d} items ({ids.shape[1]:4d} tokens at most): copy accuracy {accuracy:.3f}"
                if args.by_kind:
                    whole = float((right.sum(1) == mask.sum(1)).float().mean())
                    line += f", {kinds[0]:5s} copied whole {whole:.2f}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
