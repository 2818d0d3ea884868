"""An ordered, bounded process map for data preparation (stage-1 tokenizing and interleaving).

Why not ``datasets.map(num_proc=N)``: measured on 3.2M tokens with the real Qwen2.5 tokenizer, its
workers gave 0.95x of one process where the raw tokenizer in two processes gives 1.9x (the text's round
trip through Arrow, per-row conversion of the results, each job's set-up). Here the parent reads the
input (so bad records are reported with file and line, in order), each worker holds its own copy of the
per-run ``state`` (sent once, at start), items go out and results come back as arrays or Arrow tables,
and they are yielded in input order, so N processes write exactly what one writes.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")

_STATE: Any = None  # a worker process's own copy of the run's state (set once by _start_worker)


def ordered_map(fn: Callable[[Any, Item], Any], items: Iterable[Item], state: Any, workers: int
                ) -> Iterator[tuple[Item, Any]]:
    """``(item, fn(state, item))`` for every item, in order; in ``workers`` processes when > 1.

    ``fn`` must be a module-level function. At most two items per worker are in flight, so memory stays
    bounded whatever the input's size.

    >>> list(ordered_map(divmod, [7, 9], 4, workers=1))
    [(7, (0, 4)), (9, (0, 4))]
    """
    if workers <= 1:
        for item in items:
            yield item, fn(state, item)
        return
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, initializer=_start_worker, initargs=(state,)) as pool:
        pending: collections.deque = collections.deque()
        for item in items:
            pending.append((item, pool.submit(_call, fn, item)))
            if len(pending) >= 2 * workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def _start_worker(state: Any) -> None:
    global _STATE
    _STATE = state


def _call(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_STATE, item)
