"""The refill selection's words: the choices each option takes, and the command-line flags made from them.

One table (:data:`FLAGS`) makes ``chat``/``generate``'s selection flags and reads them back into the
overrides :func:`acre_train.infer.settings.inference_settings` takes, so a new option is one row here
and one field of :class:`~acre_train.modeling.selection.Selection`. Nothing here imports torch:
``acre-train chat --help`` stays instant.

>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_selection_flags(parser)
>>> selection_overrides(parser.parse_args(["--grow", "2", "--grow-shape", "sentences"]))["grow_shape"]
'sentences'
"""

from __future__ import annotations

import argparse
from typing import Any

POOLS = ("mean", "max")  # how a scorer pools query heads
QUERIES = ("all", "question")  # which tokens after the context a scorer pools over
KEEP_SINKS = ("spans", "tokens", "first")  # what of the context's attention sinks is always refilled
GROW_SHAPES = ("attention", "centered", "densest", "sentences")  # how grown regions take their tokens
POSITIONS = ("compact", "text")  # compact: 0..P-1 (DESIGN.md §5); text: each token's index in the context

# key: (flag, argparse keywords). The key is the override's name in inference_settings.
FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "selection": ("--selection", dict(metavar="SPEC", help=(
        "the whole refill selection in its one spelling (docs/selection.md), e.g. "
        "'l2:layers=3,heads=max,sinks=4 +grow=2,sentences eta=512'; replaces the export's (and its length "
        "bands); the flags below change parts of it"))),
    "scorer": ("--scorer", dict(metavar="SPEC", help=(
        "how spans are ranked: l1 | l2 | bounds with options, e.g. 'l2:layers=3,heads=max,sinks=4' "
        "(default: the export's, written by 'acre-train calibrate'; else 'l1:layers=-1')"))),
    "scoring_layers": ("--scoring-layers", dict(type=int, nargs="+", help="replace the scorer's layers")),
    "neighbors": ("--neighbors", dict(action=argparse.BooleanOptionalAction,
                                      help="each refilled span brings its better-scored neighbour (same budget k)")),
    "grow": ("--grow", dict(type=int, metavar="N", help=(
        "refill tokens, not whole spans (l2 scorers): N regions within the same k*l budget; 0 = whole spans "
        "(default: the export's)"))),
    "grow_shape": ("--grow-shape", dict(choices=GROW_SHAPES, help=(
        "how --grow regions take their tokens: toward the most-attended neighbour (attention), k*l/N tokens "
        "centred on each seed (centered), the N windows of k*l/N tokens holding the most mass (densest), those "
        "windows moved onto whole sentences (sentences); default: the export's, else attention"))),
    "positions": ("--positions", dict(choices=POSITIONS, help=(
        "where the refilled cache is rotated: contiguous from 0 (compact, the layout stage 2 trains in) or at "
        "each token's place in the context (text; the context must fit the base's window); default: the "
        "export's, else compact"))),
    "close_tail": ("--close-tail", dict(action=argparse.BooleanOptionalAction, help=(
        "run the context's unfinished last chunk once when the cache is built (a question then runs only its "
        "own tokens; the tail attends to the L1 memory, not the refilled spans); default: the export's, else off"))),
    "refill_after_tail": ("--refill-after-tail", dict(action=argparse.BooleanOptionalAction, help=(
        "with --close-tail: put the refilled tokens after the closed tail, next to the question, instead of "
        "before it (docs/selection.md); default: the export's, else off"))),
    "reuse_score_pass": ("--reuse-score-pass", dict(action=argparse.BooleanOptionalAction, help=(
        "with --close-tail: take the question's layers up to the last scoring layer from its scoring pass "
        "instead of running them again (they then do not see the refill; docs/selection.md); default: the "
        "export's, else off"))),
}


def add_selection_flags(group) -> None:
    """Every selection flag of :data:`FLAGS` on an argparse parser or group (each defaults to None: the
    export's value)."""
    for key, (flag, kwargs) in FLAGS.items():
        group.add_argument(flag, dest=key, default=None, **kwargs)


def selection_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags' values by key (None where not given), for ``inference_settings``."""
    return {key: getattr(args, key, None) for key in FLAGS}
